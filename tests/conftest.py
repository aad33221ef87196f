"""Suite-wide settings.

Under CI (``CI`` set, as `.ci/run` is invoked) hypothesis runs derandomized: every property test explores a
fixed, reproducible set of examples, so a red CI is reproducible and a green one is not luck. Locally it
keeps exploring new examples on every run (and stores failures in .hypothesis/).
"""
import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

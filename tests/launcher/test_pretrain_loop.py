"""Megatron-LM's own training loop, on CPU: unmodified ``pretrain_gpt.py`` -> ``pretrain()`` on gloo through
``python -m libra_megatron.launch`` (with the test harness ``libra_megatron.testing.cpu_shims``).

Data: a real Megatron indexed dataset (.bin/.idx) whose documents have the lengths of the first 400 files of
the linux-6.12 trace shipped in data/traces (median 367 tokens, max 41,356: several EOD-separated documents
per 1024-token sequence, a few sequences inside one long document); tokens are synthetic. Model: the tiny
Qwen3-shaped GPT of ``configs/cpu/tiny-qwen3.args``. Four iterations of GBS=8 sequences, L=1024.

Five runs per Megatron-LM release (core_v0.16.1, core_v0.19.0; the corpus is shared), shared by the tests
(about two minutes per release on two cores):

* DP=4, P=2, Libra (VRSP + TAP), ``--save`` every 2 iterations, TensorBoard, started with
  ``scripts/cpu_pretrain.sh``;
* DP=4, plain Megatron-LM: no ``--spec``/``--libra-*`` flags, ``--reset-attention-mask`` (Megatron's dense
  per-document causal mask), started with ``scripts/cpu_pretrain.sh --without-libra``;
* DP=4, Libra resumed with ``--load`` from iteration 2 of the first run;
* DP=2 x CP=2, P=2, Libra;
* DP=2 x CP=2, Libra with ``--libra-disable-vrsp --libra-disable-tap``: the reference at CP=2, because plain
  Megatron-LM cannot run CP on CPU (megatron-core's local ``DotProductAttention`` asserts
  ``context_parallel_size == 1``; CP needs Transformer Engine's attention).

VRSP reorders each step's sequences across DP ranks and TAP moves attention tiles between ranks; neither
changes a step's sample multiset, so every iteration's loss (a mean over the step's tokens) and gradient
norm must match the reference.
"""
import pytest

from .megatron_lm import needs_megatron_lm
from .pretrain_runs import (
    LIBRA_FLAGS,
    TRAIN_ITERS,
    common_flags,
    max_relative_difference,
    relative_difference,
    run_pretrain,
)

pytestmark = needs_megatron_lm
TOLERANCE = 1e-4
ITERATIONS = range(1, TRAIN_ITERS + 1)
LIBRA_SCALARS = ("libra/inter_pool_r1_before", "libra/inter_pool_r1_after", "libra/lane_r1_before",
                 "libra/lane_r1_after", "libra/intra_pool_max_over_mean_home",
                 "libra/intra_pool_max_over_mean_placed", "libra/bytes_q", "libra/bytes_kv", "libra/bytes_o",
                 "libra/planner_latency_s", "libra/microbatch_max_mean_before", "libra/microbatch_max_mean_after",
                 "libra/microbatch_slowest_after_over_before")


@pytest.fixture(scope="module")
def common(linux_corpus, megatron_lm_release, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp(f"index-cache-{megatron_lm_release}"))
    return common_flags(linux_corpus, cache, megatron_lm_release)


@pytest.fixture(scope="module")
def dp4(common, megatron_lm_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("dp4")
    checkpoint = str(root / "checkpoint")
    libra = run_pretrain(4, common + LIBRA_FLAGS + ["--save", checkpoint, "--save-interval", "2"],
                         root / "libra", megatron_lm_path, via_script=True).check()
    plain = run_pretrain(4, common + ["--reset-attention-mask"], root / "plain", megatron_lm_path,
                         via_script=True, without_libra=True).check()
    resumed = run_pretrain(4, common + LIBRA_FLAGS + ["--load", checkpoint, "--ckpt-step", "2"],
                           root / "resumed", megatron_lm_path).check()
    return {"libra": libra, "plain": plain, "resumed": resumed}


@pytest.fixture(scope="module")
def cp2(common, megatron_lm_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("cp2")
    flags = common + LIBRA_FLAGS + ["--context-parallel-size", "2"]
    libra = run_pretrain(4, flags, root / "libra", megatron_lm_path).check()
    reference = run_pretrain(4, flags + ["--libra-disable-vrsp", "--libra-disable-tap"], root / "reference",
                             megatron_lm_path).check()
    return {"libra": libra, "reference": reference}


def _print_losses(name, run):
    """The printed lm loss per iteration (docs/launcher.md quotes these lines)."""
    print(f"\n{name}: printed lm loss " + " / ".join(run.printed[it]["lm loss"] for it in sorted(run.printed)))


def _assert_parity(name, run, reference):
    """Printed lm loss per iteration (same start iteration, same print quirk) and TensorBoard's full-precision
    lm loss and grad norm (Megatron prints the grad norm with 3 decimals) within 1e-4 relative."""
    assert sorted(run.printed) == sorted(reference.printed) == list(ITERATIONS)
    printed = max(relative_difference(run.printed_value(it, "lm loss"), reference.printed_value(it, "lm loss"))
                  for it in ITERATIONS)
    for it in ITERATIONS:
        assert abs(run.printed_value(it, "grad norm") - reference.printed_value(it, "grad norm")) <= 1.5e-3
    loss = max_relative_difference(run, reference, "lm loss")
    grad_norm = max_relative_difference(run, reference, "grad-norm")
    print(f"\n{name}: max rel. diff over iterations 1-{TRAIN_ITERS}: printed lm loss {printed:.1e}, "
          f"lm loss {loss:.1e}, grad norm {grad_norm:.1e} (TensorBoard)")
    assert printed <= TOLERANCE and loss <= TOLERANCE and grad_norm <= TOLERANCE


def test_dp4_pool2_libra_matches_plain_megatron_lm_per_iteration(dp4, megatron_lm_release):
    for name in ("libra", "plain", "resumed"):
        _print_losses(f"{megatron_lm_release} DP=4 {name}", dp4[name])
    _assert_parity(f"{megatron_lm_release} DP=4 P=2 Libra vs plain Megatron-LM", dp4["libra"], dp4["plain"])
    losses = [dp4["plain"].scalars["lm loss"][it] for it in ITERATIONS]
    assert len(set(losses)) == TRAIN_ITERS  # the model trains: every iteration has its own loss


def test_dp2_cp2_pool2_libra_matches_libra_without_vrsp_and_tap(cp2):
    _assert_parity("DP=2 CP=2 P=2 Libra vs Libra without VRSP/TAP", cp2["libra"], cp2["reference"])
    reference = cp2["reference"].scalars  # the ablation: sampler order, every tile at its query's home rank
    assert reference["libra/inter_pool_r1_after"] == reference["libra/inter_pool_r1_before"]
    assert reference["libra/intra_pool_max_over_mean_placed"] == reference["libra/intra_pool_max_over_mean_home"]
    assert all(reference["libra/bytes_q"][it] == reference["libra/bytes_o"][it] == 0 for it in ITERATIONS)


def test_libra_really_reorders_and_moves_tiles_in_both_layouts(dp4, cp2):
    """The parity above is not vacuous: VRSP changed some step's balance and TAP moved KV bytes. The default sync
    placement balances lanes (DP=4, P=2: two lanes; pools inside a lane are cut like with like, so the
    per-instance R-1 may rise); with one lane (DP=2, P=2) it is the per-instance refined placement."""
    for run, balanced in ((dp4["libra"], "lane_r1"), (cp2["libra"], "inter_pool_r1")):
        s = run.scalars
        assert any(s[f"libra/{balanced}_after"][it] < s[f"libra/{balanced}_before"][it] for it in ITERATIONS)
        assert any(s["libra/bytes_kv"][it] > 0 for it in ITERATIONS)
        assert any(s["libra/intra_pool_max_over_mean_placed"][it] < s["libra/intra_pool_max_over_mean_home"][it]
                   for it in ITERATIONS)


def test_default_sync_placement_balances_lanes_across_ga_steps_in_the_loop(dp4, cp2):
    """--libra-sequence-placement is not given, so the default (sync) ran: DP=4 (or 2) with P=2 gives 2 (or 1)
    lanes of 2 GA steps; its lane totals (sum over GA steps of sum l^2) are never worse than the sampler's and
    better in some step, which needs sequences moved between lanes (tests/megatron/test_sampler.py shows
    they also change GA step)."""
    s = dp4["libra"].scalars
    assert all(s["libra/lane_r1_after"][it] <= s["libra/lane_r1_before"][it] + 1e-12 for it in ITERATIONS)
    assert any(s["libra/lane_r1_after"][it] < s["libra/lane_r1_before"][it] for it in ITERATIONS)
    one_lane = cp2["libra"].scalars  # DP=2, P=2: one lane holds everything, its total cannot change
    assert all(one_lane["libra/lane_r1_after"][it] == one_lane["libra/lane_r1_before"][it] == 0.0 for it in ITERATIONS)


def test_libra_scalars_are_in_the_tensorboard_event_files(dp4):
    """Read back with tensorboard's EventAccumulator, at every logged iteration, next to Megatron's own."""
    scalars = dp4["libra"].scalars
    for tag in LIBRA_SCALARS + ("lm loss", "grad-norm"):
        assert sorted(scalars.get(tag, {})) == list(ITERATIONS), tag
    assert all(scalars["libra/planner_latency_s"][it] > 0 for it in ITERATIONS)
    assert all(scalars["libra/intra_pool_max_over_mean_placed"][it] >= 1 for it in ITERATIONS)
    assert not any(tag.startswith("libra/") for tag in dp4["plain"].scalars)  # plain Megatron-LM has none


def test_resume_from_iteration_2_repeats_iterations_3_and_4_exactly(dp4):
    """``--load`` at iteration 2 (``--ckpt-step 2``; the run saved at 2 and 4) trains iterations 3 and 4 on
    the same windows with the same weights: Megatron's checkpoint carries consumed_train_samples, from which
    the Libra sampler restarts at window 2."""
    resumed, uninterrupted = dp4["resumed"], dp4["libra"]
    assert "successfully loaded checkpoint" in resumed.output and "at iteration 2" in resumed.output
    assert sorted(resumed.printed) == [3, 4]
    assert resumed.printed[3]["lm loss"] == uninterrupted.printed[3]["lm loss"]  # both first-of-interval
    for tag in ("lm loss", "grad-norm", "libra/inter_pool_r1_before", "libra/inter_pool_r1_after",
                "libra/lane_r1_after", "libra/bytes_kv"):
        assert [resumed.scalars[tag][it] for it in (3, 4)] == [uninterrupted.scalars[tag][it] for it in (3, 4)], tag


def test_each_pool_is_planned_once_across_its_ranks(dp4):
    """Issue 25: at DP=4, P=2 each microbatch has 2 pools of 2 ranks, and the TensorBoard rank's metrics read every
    pool of the window too. The ranks' planner processes share the run's plan directory (``plan_store``): the
    ledger they append to holds one planning call per distinct pool, never a pool's key (its document lengths)
    twice (without the sharing each pool's 2 ranks would both plan it). At most the 2 pools x 2 microbatches x 4 iterations the run
    trained; fewer because sequences inside the corpus's 41K-token document make identical pools. The run's plan
    directory (under ``LIBRA_PLAN_SHARE_DIR``) is gone once the run ends."""
    for name in ("libra", "resumed"):
        keys = [line.split()[0] for line in dp4[name].ledger]
        print(f"\n{name}: {len(keys)} planning calls by {len({line.split()[2] for line in dp4[name].ledger})} "
              f"planner processes")
        assert len(keys) >= 2 and len(keys) == len(set(keys)), dp4[name].ledger
    assert len(dp4["libra"].ledger) <= 2 * 2 * TRAIN_ITERS
    assert not dp4["libra"].plan_files_left and not dp4["resumed"].plan_files_left  # the processes cleaned up
    assert not dp4["plain"].ledger  # plain Megatron-LM starts no planner

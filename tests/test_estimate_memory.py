"""scripts/estimate_memory.py: hand-computed cases, and the headers of every shipped config match its output."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUN_CONFIGS = sorted((REPO / "configs").glob("qwen3-*.args"))


def _script():
    spec = importlib.util.spec_from_file_location("estimate_memory", REPO / "scripts" / "estimate_memory.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


em = _script()

DENSE = """--num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention
--num-query-groups 2 --kv-channels 16 --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
--vocab-size 1000 --make-vocab-size-divisible-by 128 --seq-length 1024 --tensor-model-parallel-size 2
--pipeline-model-parallel-size 2 --context-parallel-size 2 --sequence-parallel --bf16 --use-distributed-optimizer
--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 --libra-pool-size 2 --libra-tau 0.5
"""

MOE = """--num-layers 2 --hidden-size 32 --num-attention-heads 4 --kv-channels 8 --num-experts 4 --moe-ffn-hidden-size 16
--moe-router-topk 2 --swiglu --disable-bias-linear --vocab-size 500 --make-vocab-size-divisible-by 100
--seq-length 64 --expert-model-parallel-size 2 --use-distributed-optimizer
"""


def _estimate(tmp_path, text, dp=None):
    path = tmp_path / "case.args"
    path.write_text(text)
    shape = em.shape_from_flags(em.parse_flags(em.read_config(str(path))), str(path), dp)
    return shape, em.estimate(shape)


def test_dense_case_with_tp_pp_cp_recompute_and_libra_matches_hand_arithmetic(tmp_path):
    shape, stages = _estimate(tmp_path, DENSE)
    assert (shape.dp, shape.vocab) == (2, 1024)  # DP = P; vocab 1000 padded to a multiple of 128*TP = 256
    # one layer on a TP rank: norms 2*64, QKV 64*(4+2*2)*16/2, proj 4*16*64/2, SwiGLU (64*256 + 128*64)/2
    layer = 128 + 4096 + 2048 + 12288
    first, last = 2 * layer + 1024 * 64 // 2, 2 * layer + 64 + 1024 * 64 // 2  # embedding / norm + output
    # activations (t = 1024/CP = 512 tokens, t_sp = 256): one layer keeps 2*t_sp*h*2 + t*(4+4)*16/2*2
    # + t*4*16/2*2 (attention) + 2*t_sp*h*2 + 3*t*128/2*2 (MLP); each stage keeps one input per layer and
    # microbatch in flight (2 on stage 0, 1 on stage 1) of t_sp*h*2 bytes, plus one layer being recomputed
    one_layer = 65536 + 65536 + 32768 + 65536 + 196608
    # Libra (tau 0.5): Q and O of 1.5*t tokens x 2 heads x 16 x 2 B, lse 4 B x 1.5*t x 2, K|V of L=1024 x 1 x 16
    libra = 2 * 768 * 2 * 16 * 2 + 4 * 768 * 2 + 2 * 1024 * 1 * 16 * 2
    assert stages[0] == {"params": 2 * first, "grads": 4 * first, "optimizer": 12 * first / 4,
                         "activations": 2 * 2 * 256 * 64 * 2 + one_layer, "logits": 0.0, "libra": libra,
                         "total": 2 * first + 4 * first + 3 * first + 131072 + one_layer + libra}
    assert stages[1]["params"] == 2 * last and stages[1]["optimizer"] == 12 * last / 4
    assert stages[1]["activations"] == 1 * 2 * 256 * 64 * 2 + one_layer
    assert stages[1]["logits"] == 512 * 1024 / 2 * 6  # bf16 logits + fp32 softmax
    assert stages[1]["total"] == 2863936


def test_moe_case_shards_experts_over_ep_and_their_optimizer_over_expert_dp(tmp_path):
    shape, (stage,) = _estimate(tmp_path, MOE, dp=4)
    assert (shape.etp, shape.kv_heads, shape.vocab) == (1, 4, 500)  # ETP follows TP=1; no GQA
    # dense per layer: norms 64, QKV 32*12*8, proj 4*8*32, router 4*32; experts: 4/EP=2 local x 3*32*16
    dense, expert = 2 * (64 + 3072 + 1024 + 128) + 500 * 32 + 32, 2 * 2 * 1536  # tied output: no extra table
    assert stage["params"] == 4 * (dense + expert) and stage["grads"] == 4 * (dense + expert)
    # fp32 Adam m+v: dense over DP*CP = 4, experts over expert-DP = 4*1*1/(2*1) = 2
    assert stage["optimizer"] == 8 * (dense / 4 + expert / 2)
    # no recompute: both layers keep everything, fp32 (4 B): attention 16384 + 24576 + 8192, MoE 16384 +
    # router 8*64*4 + 64*2 routed tokens x (2*32 + 3*16) x 4, stock core attention 64*(8+4)*8*4 + 4*64*4
    per_layer = 16384 + 24576 + 8192 + 16384 + 2048 + 57344 + 25600
    assert stage["activations"] == 2 * per_layer
    assert stage["logits"] == 64 * 500 * 4 and stage["libra"] == 0.0
    assert stage["total"] == 748864


def test_cross_entropy_fused_by_transformer_engine_keeps_only_bf16_logits(tmp_path):
    base, fused = (_estimate(tmp_path, DENSE + extra)[1][1]["logits"]
                   for extra in ("", "--cross-entropy-loss-fusion --cross-entropy-fusion-impl te\n"))
    assert (base, fused) == (512 * 512 * 6, 512 * 512 * 2)


def test_layout_errors_name_the_flags(tmp_path):
    with pytest.raises(ValueError, match="--num-layers 4 must be divisible by --pipeline-model-parallel-size 3"):
        _estimate(tmp_path, DENSE + "--pipeline-model-parallel-size 3\n")
    with pytest.raises(ValueError, match="pass --dp"):
        _estimate(tmp_path, MOE)


@pytest.mark.parametrize("config", RUN_CONFIGS, ids=lambda p: p.stem)
def test_shipped_config_header_is_what_the_script_prints(config):
    """Headers cannot go stale: refresh them with `python scripts/estimate_memory.py --write configs/qwen3-*.args`."""
    expected = em.header_lines(str(config))
    assert em.current_header(config.read_text()) == expected
    total = max(float(line.rsplit("total ", 1)[1].split()[0]) for line in expected if "total" in line)
    assert total < 80 * 0.9, f"{config.name}: {total} GiB leaves < 10% headroom on an 80 GiB GPU"


def test_cli_prints_the_block_and_reports_bad_input_in_one_line(tmp_path):
    config = RUN_CONFIGS[0]
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "estimate_memory.py"), str(config)],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and out.stdout.splitlines() == em.header_lines(str(config))
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "estimate_memory.py"), str(tmp_path / "nope.args")],
                         capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "estimate_memory: error:" in bad.stderr


def _worst_total(config):
    return max(float(line.rsplit("total ", 1)[1].split()[0]) for line in em.header_lines(str(config)) if "total" in line)


def test_memory_tables_in_readme_and_launcher_doc_are_the_scripts_numbers():
    for doc in (REPO / "README.md", REPO / "docs" / "launcher.md"):
        rows = {}
        for line in doc.read_text(encoding="utf-8").splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("| qwen3-") and len(cells) >= 3:
                rows[cells[0]] = float(cells[-1].split()[0])
        assert rows == {c.stem: _worst_total(c) for c in RUN_CONFIGS}, doc.name

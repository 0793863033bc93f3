"""Training as a user runs it: data packing, the hybrid LM, CP == no CP, resume, loss falling (CPU)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hybrid_lm.data import IGNORE_INDEX, ByteTokenizer, DocumentPacker, load_corpus, load_documents
from hybrid_lm.model import HybridLM, HybridLMConfig, training_flops
from hybrid_lm.trainer import main

ROOT = Path(__file__).resolve().parents[2]
PRETRAIN = ROOT / "examples" / "pretrain.py"
# a tiny model, fp32, one thread per process: exact enough for 1e-5 comparisons
TINY = ["--layers", "2", "--hidden", "64", "--heads", "2", "--attn-every", "2", "--seq-len", "512",
        "--lr", "3e-3", "--log-every", "1", "--threads", "1", "--device", "cpu", "--backend", "torch"]


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nproc: int, args: list[str], timeout: float = 150):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", str(PRETRAIN), *args]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:  # a hang fails the test instead of blocking CI
        pytest.fail(f"torchrun timed out after {timeout}s:\n{err.stdout}\n{err.stderr}")
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


# ---------------------------------------------------------------------------------------------- data


def test_corpus_ships_with_the_example_and_is_real_text():
    text = load_corpus()
    assert 100_000 < len(text.encode()) < 400_000
    assert "Refrangibility" in text and "Prism" in text
    docs = load_documents()
    assert len(docs) > 100 and all(len(d.encode()) >= 64 for d in docs[:-1])


def test_tokenizer_round_trips_utf8():
    tok = ByteTokenizer()
    ids = tok.encode("Æther × light")
    assert ids[0] == tok.BOS and ids[-1] == tok.EOS and max(ids) < tok.vocab_size
    assert tok.decode(ids) == "Æther × light"


def test_packer_is_deterministic_stateless_and_labels_stay_inside_documents():
    a, b = DocumentPacker(777, seed=3), DocumentPacker(777, seed=3)
    for step in (0, 5, 400):  # step 400 is past the first epoch
        x, y = a.batch(step), b.batch(step)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.cu_seqlens, y.cu_seqlens)
        cu = x.cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] == 777 and all(q > p for p, q in zip(cu, cu[1:]))
        for s, e in zip(cu[:-1], cu[1:]):
            assert x.labels[e - 1] == IGNORE_INDEX
            assert torch.equal(x.labels[s : e - 1], x.input_ids[s + 1 : e])
    # consecutive batches tile the stream: the documents' bytes come back in order
    assert not torch.equal(a.batch(0).input_ids, DocumentPacker(777, seed=4).batch(0).input_ids)
    stream = torch.cat([a.batch(s).input_ids for s in range(3)])
    assert torch.equal(stream, DocumentPacker(3 * 777, seed=3).batch(0).input_ids)


def test_dp_split_cuts_documents_at_the_edges():
    batch = DocumentPacker(1000, seed=0, min_doc_bytes=10_000).batch(0)  # few long documents
    parts = batch.split(2)
    assert [p.num_tokens for p in parts] == [500, 500]
    assert torch.equal(torch.cat([p.input_ids for p in parts]), batch.input_ids)
    assert sum(p.num_targets for p in parts) == batch.num_targets - 1  # the label across the cut


# --------------------------------------------------------------------------------------------- model


def test_hybrid_lm_documents_in_a_packed_row_do_not_see_each_other():
    torch.manual_seed(0)
    cfg = HybridLMConfig(hidden_size=64, num_layers=2, num_heads=2, attn_every=2, gdn_kwargs={"backend": "torch"})
    model = HybridLM(cfg).double()
    assert [b.is_attention for b in model.blocks] == [False, True]
    lengths = [37, 70, 21]
    ids = torch.randint(0, cfg.vocab_size, (1, sum(lengths)))
    cu = torch.tensor([0, 37, 107, 128], dtype=torch.int32)
    packed = model(ids, cu_seqlens=cu)
    assert packed.shape == (1, 128, cfg.vocab_size) and packed.dtype == torch.float32
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = model(ids[:, s:e])
        torch.testing.assert_close(packed[:, s:e], alone, rtol=1e-5, atol=1e-5)
    # the head is tied to the embedding
    assert model.lm_head_weight is model.embed.weight


def test_block_checkpointing_gives_the_same_loss_and_gradients():
    """Activation checkpointing recomputes each block in the backward: same numbers, less memory."""
    torch.manual_seed(0)
    cfg = HybridLMConfig(hidden_size=64, num_layers=2, num_heads=2, attn_every=2, gdn_kwargs={"backend": "torch"})
    model = HybridLM(cfg).double()
    ids = torch.randint(0, cfg.vocab_size, (1, 150))
    cu = torch.tensor([0, 60, 150], dtype=torch.int32)
    results, kept = [], []
    for flag in (False, True):
        model.checkpoint_blocks = flag
        model.zero_grad()
        nbytes = [0]

        def pack(t, nbytes=nbytes):
            nbytes[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(ids, cu_seqlens=cu)
        logits.double().logsumexp(-1).sum().backward()
        kept.append(nbytes[0])
        results.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert kept[1] < kept[0] / 2, kept  # the blocks' activations were not kept for the backward
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-12, atol=1e-14, msg=name)


# ------------------------------------------------------------------------------------------ training


def test_loss_falls_on_the_tiny_config_in_one_process(tmp_path):
    losses = main([*TINY, "--steps", "30", "--seed", "1", "--warmup", "5"])
    assert len(losses) == 30
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert first > 5.0, losses  # ~ln(258) at initialisation
    assert last < first - 1.5, losses


def test_model_flops_count_tokens_for_gdn_and_token_pairs_for_attention():
    gdn_only = HybridLM(HybridLMConfig(hidden_size=64, num_layers=2, num_heads=2))
    assert training_flops(gdn_only, [100, 300]) == training_flops(gdn_only, [400]) == 4 * training_flops(gdn_only, [100])
    weights = sum(p.numel() for n, p in gdn_only.named_parameters()
                  if "proj" in n or n.endswith(("conv1d.weight", "up.weight", "gate.weight", "down.weight")))
    per_token = training_flops(gdn_only, [1])
    assert 6 * (weights + gdn_only.embed.weight.numel()) < per_token < 6 * (weights + gdn_only.embed.weight.numel()) * 2
    hybrid = HybridLM(HybridLMConfig(hidden_size=64, num_layers=2, num_heads=2, attn_every=2))
    # one attention layer: the same tokens in one document cost the pairs' difference more
    pairs = (400 * 401 // 2) - 2 * (200 * 201 // 2)
    assert training_flops(hybrid, [400]) - training_flops(hybrid, [200, 200]) == 3 * 4 * 64 * pairs


def test_log_shows_mfu_given_a_peak(capsys):
    main([*TINY, "--steps", "2", "--peak-tflops", "0.001"])
    assert "MFU" in capsys.readouterr().out
    main([*TINY, "--steps", "2"])
    assert "MFU" not in capsys.readouterr().out  # no peak known for a CPU


def test_resume_continues_the_same_loss_curve(tmp_path):
    straight = main([*TINY, "--steps", "6", "--seed", "2"])
    ckpt = tmp_path / "ckpt"
    first = main([*TINY, "--steps", "3", "--seed", "2", "--save", str(ckpt)])
    assert (ckpt / "checkpoint.pt").exists()
    state = torch.load(ckpt / "checkpoint.pt", weights_only=False)
    assert state["step"] == 3 and {"model", "optimizer", "rng", "args"} <= set(state)
    second = main([*TINY, "--steps", "6", "--seed", "2", "--resume", str(ckpt)])
    assert len(first) == 3 and len(second) == 3
    assert first + second == pytest.approx(straight, rel=1e-12, abs=0)


@pytest.mark.slow
@pytest.mark.parametrize("intra,ckpt", [("off", False), ("2", False), ("off", True)])
def test_two_process_cp_gives_the_single_process_losses(tmp_path, intra, ckpt):
    """torchrun --nproc-per-node 2 --cp 2 (gloo) == 1 process without CP, step by step, fp32;
    inter-card CP alone, dual CP (each rank's slice further split into 2 intra partitions), and
    CP with activation checkpointing (the recompute replays the CP collectives)."""
    args = [*TINY, "--steps", "4", "--seed", "5", "--min-doc-bytes", "300"]
    single = main(args)
    out = tmp_path / "cp.jsonl"
    extra = ["--checkpoint-blocks"] if ckpt else []
    log = _torchrun(2, [*args, "--cp", "2", "--cp-intra", intra, "--metrics-out", str(out), *extra])
    assert "world 2 = dp 1 x cp 2" in log and "tokens/s" in log and "elapsed" in log
    cp = _losses(out)
    assert len(cp) == 4
    assert cp == pytest.approx(single, rel=1e-5), (cp, single)


@pytest.mark.slow
def test_two_process_data_parallel_runs_and_matches_a_single_process_batch_of_two_rows(tmp_path):
    """cp=1 on 2 ranks is data parallel: the same global batch cut into 2 rows; the first loss is the
    mean over both rows, identical to what one process computes on the same rows."""
    args = [*TINY, "--steps", "2", "--seed", "6"]
    out = tmp_path / "dp.jsonl"
    _torchrun(2, [*args, "--cp", "1", "--metrics-out", str(out)])
    dp = _losses(out)

    # one process: the first step's loss over the two rows of the split batch
    torch.manual_seed(6)
    from hybrid_lm.trainer import build_parser, model_config

    model = HybridLM(model_config(build_parser().parse_args(args)))
    rows = DocumentPacker(512, seed=6).batch(0).split(2)
    total, n = 0.0, 0
    with torch.no_grad():
        for r in rows:
            logits = model(r.input_ids[None], cu_seqlens=r.cu_seqlens)
            total += torch.nn.functional.cross_entropy(logits[0], r.labels, ignore_index=IGNORE_INDEX, reduction="sum").item()
            n += r.num_targets
    assert dp[0] == pytest.approx(total / n, rel=1e-5)
    assert dp[1] < dp[0]


# ----------------------------------------------------------------------------- Qwen3-Next swap example


@pytest.mark.slow
def test_qwen3_next_swap_example_trains_and_cp_matches_one_process(tmp_path):
    pytest.importorskip("transformers")
    from qwen3_next_swap import main as swap_main  # examples/ is on the path (conftest)
    args = ["--steps", "4", "--seq-len", "256", "--hidden", "64", "--layers", "2", "--linear-only",
            "--backend", "torch", "--device", "cpu", "--log-every", "1"]
    single = swap_main(args)  # asserts the swapped logits match transformers' before training
    assert len(single) == 4 and single[-1] < single[0]
    out = tmp_path / "swap.jsonl"
    script = ROOT / "examples" / "qwen3_next_swap.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", str(script), *args,
           "--cp", "2", "--metrics-out", str(out)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"torchrun timed out:\n{err.stdout}\n{err.stderr}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _losses(out) == pytest.approx(single, rel=1e-5)


def test_recompute_states_flag_reaches_every_gdn_layer():
    """--recompute-states turns the GDN forward's kept chunk states off (save_states=False) in
    every GDN layer of the model; by default they are kept."""
    from flash_qla_cp.modules.gated_deltanet import GatedDeltaNet
    from hybrid_lm.trainer import build_parser, model_config

    for flags, want in (([], True), (["--recompute-states"], False)):
        model = HybridLM(model_config(build_parser().parse_args([*TINY, *flags])))
        layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
        assert layers and all(m.save_states is want for m in layers)


@pytest.mark.parametrize("flags, words", [
    (["--dtype", "fp16"], "--dtype"),
    (["--dtype", "bogus"], "--dtype"),
    (["--cp-intra", "bogus"], "--cp-intra"),
    (["--layers", "0"], "--layers"),
    (["--threads", "-1"], "--threads"),
    (["--device", "tpu"], "--device"),
    (["--lr", "nan"], "--lr"),
    (["--clip", "-1"], "--clip"),
    (["--min-lr-ratio", "2"], "--min-lr-ratio"),
    (["--timeout", "0"], "--timeout"),
    (["--peak-tflops", "-1"], "--peak-tflops"),
])
def test_bad_flags_name_themselves(flags, words, capsys):
    with pytest.raises(SystemExit):
        main([*TINY, "--steps", "1", *flags])
    assert words in capsys.readouterr().err


def test_resume_errors_name_the_flag(tmp_path):
    ckpt = tmp_path / "ckpt"
    main([*TINY, "--steps", "2", "--save", str(ckpt)])
    # the checkpoint file itself works as well as its folder
    assert len(main([*TINY, "--steps", "3", "--resume", str(ckpt / "checkpoint.pt")])) == 1
    with pytest.raises(SystemExit, match="--resume .*no checkpoint there"):
        main([*TINY, "--steps", "3", "--resume", str(tmp_path / "typo")])
    with pytest.raises(SystemExit, match="another model configuration.*hidden"):
        main([*TINY, "--steps", "3", "--hidden", "32", "--resume", str(ckpt)])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit, match="not a readable checkpoint"):
        main([*TINY, "--steps", "3", "--resume", str(tmp_path / "bad")])
    # a run resuming from its own, still empty, save directory starts at step 0 (a first run)
    fresh = tmp_path / "fresh"
    assert len(main([*TINY, "--steps", "1", "--save", str(fresh), "--resume", str(fresh)])) == 1


@pytest.mark.slow
def test_a_stalled_rank_ends_the_job_within_the_timeout(tmp_path):
    """--timeout: a rank that never reaches a collective (here: asleep) makes the other rank's
    collective fail after the timeout, and torchrun then ends the job on every rank, non-zero,
    instead of waiting torch's default 30 minutes."""
    script = tmp_path / "stall.py"
    script.write_text(
        "import sys, time, torch\n"
        f"sys.path.insert(0, {str(ROOT / 'examples')!r})\n"
        "from hybrid_lm.trainer import Dist\n"
        "d = Dist(1, 'cpu', timeout_minutes=0.05)\n"  # 3 s
        "if d.rank == 1:\n"
        "    time.sleep(600)\n"
        "d.all_reduce_sum(torch.ones(1))\n"
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", str(script)]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    seconds = time.monotonic() - start
    assert proc.returncode != 0 and seconds < 90, (proc.returncode, seconds, proc.stderr[-2000:])

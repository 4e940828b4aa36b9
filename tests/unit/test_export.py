"""`lmlaunch export RUN --to hf DIR` turns the newest checkpoint of any strategy (DDP file, FSDP2
DCP shards, ZeRO partitions) into a transformers directory: from_pretrained(DIR) gives the
logits the trained model gave at the end of training (computed by all ranks of the training
run itself, tests/unit/_train_with_stop.py), the tokenizer gives lmlaunch's byte ids, and
`model.pretrained: DIR` fine-tunes from it; the evaluator alongside (lmtrain.evaluator) scores the
sharded ones through it."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from launcher.cli import main
from launcher.context import Context
from tests.unit.test_checkpoint_resume import straight_run


def lm(runs_root: Path, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main([str(a) for a in args], Context(stdout=out, stderr=out, environ={"LMLAUNCH_RUNS_ROOT": str(runs_root)}))
    return code, out.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_export_gives_the_trained_models_logits_and_byte_ids(repo, runs_root, tmp_path, strategy):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    plan = straight_run(repo, 2, strategy)  # test_checkpoint_resume's uninterrupted run, trained once for both
    trained = torch.load(Path(plan.paths.run_dir, "final-logits.pt"), weights_only=True)

    out = tmp_path / "hf"
    code, text = lm(runs_root, "export", plan.paths.run_dir, "--to", "hf", out)
    assert code == 0, text
    assert f"exported {plan.run_name} step-12 (the newest complete checkpoint) to {out}" in text
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(input_ids=trained["input_ids"]).logits
    assert torch.allclose(logits, trained["logits"], atol=1e-5, rtol=0), (logits - trained["logits"]).abs().max()

    tok = AutoTokenizer.from_pretrained(out)
    text = "héllo, wörld\n"
    assert tok(text, add_special_tokens=False)["input_ids"] == list(text.encode("utf-8"))
    assert tok.eos_token_id == 256 and tok.decode(list(text.encode("utf-8"))) == text
    summary = json.loads((out / "lmlaunch_export.json").read_text())
    assert summary["step"] == 12 and summary["tokenizer_problems"] == [] and "warning" not in text, text
    if strategy != "ddp":  # the evaluator alongside (eval.alongside) scores a sharded checkpoint through this export
        _scored_by_the_evaluator(Path(plan.paths.run_dir), tmp_path)


def _scored_by_the_evaluator(run_dir: Path, tmp_path: Path) -> None:
    """The evaluator's process, in the evaluator's environment (the local profile's eval_python)."""
    import os
    import subprocess
    import sys

    from launcher.planning.resolve import eval_interpreter
    from launcher.spec.profiles import load_profile
    from lmcore.run import eval_alongside as ev

    plan = ev.EvaluatorPlan(partition="low", nodes=1, cpus_per_task=1, gpus=0, gres=None, mem=None,
                            tasks=("lmlaunch_pydoc_perplexity",), limit=2)  # rolling windows: any context fits
    (tmp_path / "evaluator.json").write_text(json.dumps(plan.to_json()))
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([eval_interpreter(load_profile("local"), sys.executable), "-m", "lmtrain.evaluator.main",
                           str(run_dir), "--evaluator", str(tmp_path / "evaluator.json"), "--once"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(repo / "src")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = ev.read_scores(run_dir)  # every complete checkpoint, in step order
    rec = recs[-1]
    assert [r.step for r in recs] == sorted(r.step for r in recs) and rec.step == 12 and {s["metric"] for s in rec.scores} == {"word_perplexity", "byte_perplexity", "bits_per_byte"}
    assert all(s["value"] > 0 for s in rec.scores)
    assert (ev.read_state(run_dir) or {}).get("state") == "done"


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "phi3"])
def test_the_exported_byte_tokenizer_is_checked_as_a_user_loads_it(tmp_path, model_type):
    """transformers picks Qwen2Tokenizer for any qwen2 directory (and others by model type),
    whatever tokenizer_config.json declares: it NFC-normalises, so decomposed accents encode other
    than training did; the export says so and names the loading line that works. No class may
    add a token outside the model's 260 ids (Qwen2Tokenizer added <|endoftext|> as 260)."""
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

    from lmtrain.checkpoint.export import PROBE_TEXTS, byte_tokenizer, check_tokenizer

    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.json").write_text(json.dumps({"tokenizer": {"kind": "bytes"}}))
    out = tmp_path / "hf"
    AutoConfig.for_model(model_type, vocab_size=260, pad_token_id=256).save_pretrained(out)
    byte_tokenizer().save_pretrained(out)
    problems = check_tokenizer(str(data), out, 260)
    auto = AutoTokenizer.from_pretrained(out)
    if type(auto).__name__ == "Qwen2Tokenizer":  # qwen2; phi3's forced class is the generic backend
        (problem,) = problems
        assert problem.startswith("AutoTokenizer.from_pretrained(DIR) loads Qwen2Tokenizer, which encodes "
                                  "'cafe\u0301 d\u00e9ja\u0300 vu (NFD)' other than training did"), problem
        assert problem.endswith("(load it with PreTrainedTokenizerFast.from_pretrained(DIR))")
    else:
        assert problems == [], problems
    for tok in (auto, PreTrainedTokenizerFast.from_pretrained(out)):
        assert len(tok) == 260 and tok.pad_token_id == tok.eos_token_id == 256, (type(tok).__name__, len(tok))
        for text in PROBE_TEXTS:
            assert all(0 <= i < 260 for i in tok(text, add_special_tokens=False)["input_ids"])


@pytest.mark.slow
def test_a_run_fine_tunes_from_an_exported_directory(repo, runs_root, tmp_path):
    plan = straight_run(repo, 1, "ddp")  # test_checkpoint_resume's uninterrupted run on one process
    out = tmp_path / "hf"
    assert lm(runs_root, "export", plan.paths.run_dir, "--to", "hf", out)[0] == 0
    code, text = lm(runs_root, "run", repo / "jobs" / "tiny-cpu.yaml", "--local", "--devices", "1", "--max-steps", "2",
                    "--name", "finetune", "model.type=null", f"model.pretrained={out}", "model.config={}",
                    "trainer.log_every_n_steps=1", "data.seq_len=32")
    assert code == 0, text[-3000:]
    beats = [json.loads(x) for x in (runs_root / "finetune" / "metrics" / "heartbeat.jsonl").read_text().splitlines()]
    first = [b for b in beats if b["event"] == "step"][0]
    src = [json.loads(x) for x in Path(plan.paths.run_dir, "metrics", "heartbeat.jsonl").read_text().splitlines()]
    src_first = [b for b in src if b["event"] == "step"][0]
    # starts from the trained weights, not from scratch (ln 260 = 5.56)
    assert first["loss"] < src_first["loss"] - 0.3, (first["loss"], src_first["loss"])


def test_export_refuses_a_non_empty_output_and_an_unknown_step(runs_root, tmp_path):
    run_dir = tmp_path / "r"
    (run_dir / "checkpoints" / "step-3").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-3" / "COMPLETE").write_text("{}")
    (run_dir / "plan.json").write_text(json.dumps({"paths": {"checkpoint_dir": str(run_dir / "checkpoints")}}))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("")
    code, text = lm(runs_root, "export", run_dir, "--to", "hf", busy)
    assert code == 2 and "exists and is not an empty directory" in text
    code, text = lm(runs_root, "export", run_dir, "--to", "hf", tmp_path / "new", "--step", "9")
    assert code == 2 and "--step 9: run r has no complete checkpoint of that step; complete: 3" in text

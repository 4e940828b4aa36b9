"""'Validates' means 'trains' for pipeline stages (lmtrain.model.pipeline_check, run by validate,
the dry run, submit and `run --local`): each stage's forward runs in order with the model's own
call signature, on the CPU for a small model (the stages' logits must be the whole model's) and
on the meta device for a large one; a stage that fails is refused at validate naming the stage
and the error; a model that does not run on the meta device at all is said to be unchecked."""

from __future__ import annotations

import pytest

from launcher.planning import model_check
from lmtrain.model import pipeline
from lmtrain.model.pipeline_check import check_pipeline
from tests.unit.test_model_architectures import _validate

TOKENS = {"vocab_size": 260, "pad_token_id": 256, "bos_token_id": 256, "eos_token_id": 256}
TINY = {  # 4 blocks: the interleaved schedules' 4 stages on 2 ranks
    "gpt2": {"n_layer": 4, "n_embd": 32, "n_head": 4, "n_positions": 64},
    "opt": {"num_hidden_layers": 4, "hidden_size": 32, "ffn_dim": 64, "num_attention_heads": 4,
            "max_position_embeddings": 64, "word_embed_proj_dim": 32},
    "llama": {"num_hidden_layers": 4, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64},
    "mixtral": {"num_hidden_layers": 4, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 64, "num_local_experts": 2},
}
# what the causal LM does to its head's logits: Gemma 2's final soft-capping (a tied head too),
# Cohere's logit_scale, Granite's logits_scaling (1 by default, 8 or 16 in its released models)
AFTER_THE_HEAD = {kind: {**TINY["llama"], "head_dim": 8} for kind in ("gemma2", "cohere", "granite")}
AFTER_THE_HEAD["granite"]["logits_scaling"] = 8.0
TINY.update(AFTER_THE_HEAD)


@pytest.mark.parametrize("kind", sorted(TINY))
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_the_stages_of_a_small_model_compute_the_whole_models_logits(kind, schedule):
    assert check_pipeline({"type": kind, "config": {**TINY[kind], **TOKENS}}, 2, schedule) is None


def test_a_stage_that_cannot_take_its_call_is_refused_as_opts_stand_in_once_was(monkeypatch):
    """OPT calls its learned positions with the attention mask and position_ids: a stand-in on a
    later stage that took the ids only failed at step 0 (TypeError); the check now meets it first."""
    def ids_only(self, ids):
        return pipeline.torch.zeros(*ids.shape, self.width, device=ids.device)

    monkeypatch.setattr(pipeline._Zeros, "forward", ids_only)
    with pytest.raises(ValueError, match=r"trainer.pipeline_parallel_size\(2\): model.type opt cannot run as 2 "
                                         r"pipeline stages: stage 1 \(layers 2-3\) fails: TypeError: .*position_ids"):
        check_pipeline({"type": "opt", "config": {**TINY["opt"], **TOKENS}}, 2)


@pytest.mark.parametrize("kind", sorted(AFTER_THE_HEAD))
def test_a_last_stage_that_stops_at_the_head_is_refused(monkeypatch, kind):
    """The last stage once returned the head's output, leaving out what the model's own forward does
    after it: Gemma 2 on 2 stages then trained 1.3e-4 of the loss off DDP (the equivalence bench),
    yet passed the check, whose 1e-4 tolerance was above soft-capping's effect on small logits."""
    def stops_at_the_head(lm, path, stack):  # the last stage's model: its stack, then lm_head, nothing after
        head = lm.get_output_embeddings()
        return lambda **kw: (head(stack(**kw)[0]),)

    monkeypatch.setattr(pipeline, "_with_submodule", stops_at_the_head)
    with pytest.raises(ValueError, match=rf"model.type {kind}'s 2 pipeline stages do not compute the whole model's "
                                         r"logits \(largest difference"):
        check_pipeline({"type": kind, "config": {**TINY[kind], **TOKENS}}, 2)


def test_large_models_are_checked_on_the_meta_device_and_refused_or_said_unchecked():
    # nemotron_h's blocks read their type from the block list (a stage's own list has none): refused
    with pytest.raises(ValueError, match=r"model.type nemotron_h cannot run as 2 pipeline stages: stage 1 .* fails: "
                                         r"AttributeError: .*block_type"):
        check_pipeline({"type": "nemotron_h", "config": {"num_hidden_layers": 4}}, 2)
    # a hybrid whose per-layer types are a derived property: its stages cannot be given their own
    with pytest.raises(ValueError, match=r"model.type jamba's stages cannot be built: AttributeError"):
        check_pipeline({"type": "jamba", "config": {"num_hidden_layers": 4}}, 2)
    # experts on the meta device (transformers' data-independent kernel): Mixtral's default size
    assert check_pipeline({"type": "mixtral", "config": {"num_hidden_layers": 4}}, 2) is None
    # BART's decoder reads a mask value on the host: not runnable on the meta device, said, not refused
    note = check_pipeline({"type": "bart", "config": {"num_hidden_layers": 4}}, 2)
    assert note and "the stages of model.type bart were not checked here" in note, note


def test_validate_refuses_stages_that_would_fail_naming_the_line_and_the_stage(repo, tmp_path):
    model_check._seen.clear()
    spec = {"type": "nemotron_h", "config": {"num_hidden_layers": 4, **TOKENS}}
    code, text = _validate(repo, tmp_path, spec, overrides=["trainer.strategy=fsdp", "trainer.pipeline_parallel_size=2"])
    assert code == 4 and "trainer.pipeline_parallel_size(2): model.type nemotron_h cannot run as 2 pipeline stages" in text, text
    code, text = _validate(repo, tmp_path, {"type": "opt", "config": {**TINY["opt"], **TOKENS}},
                           overrides=["trainer.strategy=fsdp", "trainer.pipeline_parallel_size=2", "data.seq_len=64"])
    assert code == 0 and text.startswith("ok:"), text
    model_check._seen.clear()

"""Token streams as served: plain text gets the BOS the tokenizer adds (vLLM's completions endpoint
adds it), chat-template text gets none on top of the template's, in every engine; and the override."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import write_jsonl
from oracle import oracle_absmax

from kvcalib.calibration.options import CalibrateOptions
from kvcalib.calibration.pipeline import calibrate
from kvcalib.core.schema import PROVENANCE_FILENAME
from kvcalib.evaluation.pipeline import EvalOptions, evaluate
from kvcalib.hf.data import load_calibration_data, tokenize_as_served

SMALL = dict(num_samples=8, max_seq_len=64)
BOS = "<|endoftext|>"  # the tiny tokenizer's bos_token
# A template that starts with the BOS, as Llama 3's and Gemma's do.
BOS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
)


@pytest.fixture(scope="module")
def bos_llama(tiny_llama_master: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama whose tokenizer adds BOS to plain text (a TemplateProcessing post-processor,
    as Llama 3's tokenizer.json has), and whose chat template starts with the BOS."""
    from tokenizers import Tokenizer, processors

    out = tmp_path_factory.mktemp("bos") / "bos-llama"
    shutil.copytree(tiny_llama_master, out)
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    bos_id = raw.token_to_id(BOS)
    raw.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    raw.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(BOS_TEMPLATE)
    return out


def _tokenizer(model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def test_plain_text_gets_the_bos_the_tokenizer_adds_once(bos_llama, text_dataset):
    tok = _tokenizer(bos_llama)
    assert tok("a b")["input_ids"][0] == tok.bos_token_id  # the fixture's tokenizer does add it
    data = load_calibration_data(str(text_dataset), tok, CalibrateOptions(**SMALL))
    texts = [json.loads(line)["text"] for line in text_dataset.read_text().splitlines()]
    served = {
        tuple(tok(t, truncation=True, max_length=64)["input_ids"]) for t in texts
    }  # as vLLM encodes a prompt
    assert all(s in served for s in data.sequences)
    assert all(s[0] == tok.bos_token_id and tok.bos_token_id not in s[1:] for s in data.sequences)
    assert data.special_tokens == (tok.bos_token_id,) and data.special_tokens_rule.startswith(
        "as served"
    )
    bare = load_calibration_data(
        str(text_dataset), tok, CalibrateOptions(add_special_tokens=False, **SMALL)
    )
    assert all(tok.bos_token_id not in s for s in bare.sequences) and bare.special_tokens == ()


def test_chat_text_gets_no_second_bos(bos_llama, tmp_path):
    tok = _tokenizer(bos_llama)
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Question {i}?"},
                {"role": "assistant", "content": "Yes."},
            ]
        }
        for i in range(4)
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    data = load_calibration_data(str(path), tok, CalibrateOptions(**SMALL))
    for s in data.sequences:
        assert s[0] == tok.bos_token_id and tok.bos_token_id not in s[1:]
    doubled = load_calibration_data(
        str(path), tok, CalibrateOptions(add_special_tokens=True, **SMALL)
    )  # the override: two BOS
    assert all(s[:2] == (tok.bos_token_id,) * 2 for s in doubled.sequences)


def test_mixed_rows_keep_their_order_and_empty_rows_stay_empty(bos_llama):
    tok = _tokenizer(bos_llama)
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi?"}], tokenize=False)
    texts, is_chat = [chat, "plain words here", "", chat], [True, False, False, True]
    decoded = [tok.decode(ids) for ids in tokenize_as_served(tok, texts, is_chat, 64)]
    assert decoded == [chat, BOS + "plain words here", "", chat]
    assert chat.count(BOS) == 1


@pytest.mark.parametrize("engine", ["native", "stream"])
def test_calibrate_measures_the_stream_the_server_builds(bos_llama, text_dataset, tmp_path, engine):
    """absmax equals transformers' own cache run on the BOS-prefixed tokens, in both engines; the
    provenance says how the rows were tokenised and what was added."""
    tok = _tokenizer(bos_llama)
    out = tmp_path / "out"
    result = calibrate(
        bos_llama,
        str(text_dataset),
        out,
        CalibrateOptions(engine=engine, batch_size=2, scale_objective="absmax", **SMALL),
    )
    texts = [json.loads(line)["text"] for line in text_dataset.read_text().splitlines()]
    sequences = [
        tok(t, truncation=True, max_length=64)["input_ids"] for t in texts[: SMALL["num_samples"]]
    ]
    k, v = oracle_absmax(bos_llama, sequences)
    assert [layer.k.absmax for layer in result.layers] == [float(x) for x in k]
    assert [layer.v.absmax for layer in result.layers] == [float(x) for x in v]
    assert result.num_tokens == sum(len(s) for s in sequences)
    provenance = json.loads((out / PROVENANCE_FILENAME).read_text())
    assert provenance["special_tokens_added"] == [tok.bos_token_id]
    assert provenance["special_tokens"].startswith("as served")


def test_eval_scores_the_served_stream_and_the_override(bos_llama, text_dataset, tmp_path):
    calibrate(bos_llama, str(text_dataset), tmp_path / "ckpt", CalibrateOptions(**SMALL))
    served = evaluate(
        tmp_path / "ckpt",
        str(text_dataset),
        EvalOptions(num_samples=8, max_seq_len=4096, order="gpu"),
    )
    bare = evaluate(
        tmp_path / "ckpt",
        str(text_dataset),
        EvalOptions(num_samples=8, max_seq_len=4096, order="gpu", add_special_tokens=False),
    )
    assert (
        served.num_tokens == bare.num_tokens + 8
    )  # whole texts: one BOS more each, and it is scored as context
    assert torch.isfinite(torch.tensor(served.baseline_nll))


def test_validate_warns_on_scales_measured_without_the_bos_the_server_adds(
    bos_llama, text_dataset, tmp_path
):
    from kvcalib.validation.pipeline import validate_checkpoint

    def rules(ckpt):
        return {f.rule for f in validate_checkpoint(ckpt, "trn2").findings}

    calibrate(bos_llama, str(text_dataset), tmp_path / "served", CalibrateOptions(**SMALL))
    assert "CALIB-TOKENS-NOT-AS-SERVED" not in rules(tmp_path / "served")
    calibrate(
        bos_llama,
        str(text_dataset),
        tmp_path / "bare",
        CalibrateOptions(add_special_tokens=False, **SMALL),
    )
    report = validate_checkpoint(tmp_path / "bare", "trn2")
    found = [f for f in report.findings if f.rule == "CALIB-TOKENS-NOT-AS-SERVED"]
    assert (
        report.ok
        and len(found) == 1
        and BOS in found[0].message
        and "--no-add-special-tokens" in found[0].message
    )
    old = tmp_path / "bare" / PROVENANCE_FILENAME  # an older kvcalib's provenance: no rule recorded
    provenance = json.loads(old.read_text())
    del provenance["special_tokens"], provenance["special_tokens_added"]
    old.write_text(json.dumps(provenance))
    assert "CALIB-TOKENS-NOT-AS-SERVED" in rules(tmp_path / "bare")
    card = (tmp_path / "served" / "README.md").read_text()
    assert "| tokens | as served: plain text with the tokenizer's default special tokens" in card


def test_the_tiny_tokenizer_without_a_bos_template_is_not_judged(
    tiny_llama_master, text_dataset, tmp_path
):
    from kvcalib.validation.pipeline import validate_checkpoint

    calibrate(
        tiny_llama_master,
        str(text_dataset),
        tmp_path / "bare",
        CalibrateOptions(add_special_tokens=False, **SMALL),
    )
    assert "CALIB-TOKENS-NOT-AS-SERVED" not in {
        f.rule for f in validate_checkpoint(tmp_path / "bare", "trn2").findings
    }

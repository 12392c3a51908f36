"""dsa_model.replay_samples: a replay report's sample outputs decoded with the model's tokenizer,
printed and appended to the report's markdown (a second run replaces its section)."""
import json

from dsa_model import replay_samples
from dsa_model.tokenizer import encode


def test_decodes_prints_and_appends_once(tmp_path, tokenizer, model_dir, capsys):
    report = {"samples": [
        {"index": 0, "status": "OK", "context_tokens": 7, "finish_reason": "EOS",
         "context_tail_ids": encode(tokenizer, "The capital of France is"),
         "token_ids": encode(tokenizer, " Paris.") + [2]},
        {"index": 1, "status": "DEADLINE_EXCEEDED", "context_tokens": 3, "finish_reason": "",
         "context_tail_ids": [], "token_ids": []},
    ]}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    markdown = tmp_path / "report.md"
    markdown.write_text("| figure | value |\n|---|---|\n")
    for _ in range(2):
        assert replay_samples.main([str(path), "--tokenizer", str(model_dir),
                                    "--markdown", str(markdown)]) == 0
    out = capsys.readouterr().out
    assert "... The capital of France is\n>>>  Paris.<|im_end|>" in out
    assert "request 1 (DEADLINE_EXCEEDED" in out
    text = markdown.read_text()
    assert text.startswith("| figure | value |\n|---|---|\n")
    assert text.count(replay_samples.MARKDOWN_HEADING) == 1
    assert "finish EOS" in text


def test_a_report_without_samples_is_refused(tmp_path, model_dir):
    path = tmp_path / "pattern.json"
    path.write_text(json.dumps({"requests": {}}))
    assert replay_samples.main([str(path), "--tokenizer", str(model_dir)]) == 1

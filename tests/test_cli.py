"""The command line: subcommands, --json, exit codes, stderr errors; local and S3 streams."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ckptstream import Stream
from ckptstream.cli import main
from ckptstream.format import manifest_path
from ckptstream.hf import iter_hf_weights
from ckptstream.storage import open_storage
from ckptstream.testing.models import TinyModelSpec, rl_like_step, write_tiny_model


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def published(stream_url, tmp_path, capsys):
    """Three versions published with the CLI, one process each (a delta needs the base from storage)."""
    model = write_tiny_model(tmp_path / "m0", TinyModelSpec())
    state = dict(iter_hf_weights(model))
    cache = str(tmp_path / "cache")
    for step in range(3):
        if step:
            rl_like_step(state, fraction=0.02)
            write_tiny_model(tmp_path / f"m{step}", TinyModelSpec(), state=state)
        code, out, _ = run(capsys, "publish", stream_url, "--from-hf", str(tmp_path / f"m{step}"), "--step",
                           str(step), "--json", "--cache-dir", cache if step == 2 else "")
        assert code == 0
        summary = json.loads(out)
        assert summary["version"] == step and summary["kind"] == ("keyframe" if step == 0 else "delta")
    return stream_url, state


def test_ls_show_verify_diff_materialize(published, tmp_path, capsys):
    url, state = published
    code, out, _ = run(capsys, "ls", url, "--json")
    rows = json.loads(out)
    assert code == 0 and [r["version"] for r in rows] == [0, 1, 2]
    assert rows[2]["base_version"] == 1 and rows[2]["stored_fraction"] < 0.2
    code, out, _ = run(capsys, "ls", url)
    assert "VERSION" in out and "delta" in out
    code, out, _ = run(capsys, "show", url, "latest", "--tensors")
    assert code == 0 and "chain        0 -> 1 -> 2" in out and "model.embed_tokens.weight" in out
    code, out, _ = run(capsys, "show", url, "2", "--json")
    assert json.loads(out)["chain"] == [0, 1, 2]
    code, out, _ = run(capsys, "verify", url)
    assert code == 0 and out.count(": ok") == 3
    code, out, _ = run(capsys, "diff", url, "1", "2", "--json")
    assert code == 0 and all(d["status"] == "changed" for d in json.loads(out))
    code, out, _ = run(capsys, "materialize", url, "latest", str(tmp_path / "out"), "--json")
    assert code == 0 and json.loads(out)["version"] == 2
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "ckptstream.json", "ckptstream_tiny_model.json", "config.json", "generation_config.json",
        "model.safetensors"]
    code, _, err = run(capsys, "materialize", url, "1", str(tmp_path / "out"))
    assert code == 5 and err.startswith("Error:") and "not empty" in err


def test_errors_have_exit_codes(published, tmp_path, capsys):
    url, _ = published
    code, _, err = run(capsys, "show", url, "9")
    assert code == 4 and "Error: version 9: no such version" in err
    code, _, err = run(capsys, "ls", str(tmp_path / "nowhere"))
    assert code == 4 and "no stream at" in err
    storage = open_storage(url)
    raw = bytearray(storage.read(manifest_path(1)))
    raw[len(raw) // 2] ^= 1
    storage.delete(manifest_path(1))
    storage.put(manifest_path(1), bytes(raw))
    code, out, err = run(capsys, "verify", url, "--json")
    results = json.loads(out)
    assert code == 3 and [r["ok"] for r in results] == [True, False, False]
    assert "version 1, file manifests/000000000001.json" in err
    code, _, err = run(capsys, "publish", url, "--from-hf", str(tmp_path / "m2"), "--version", "1")
    assert code == 5 and "not newer than the latest version 2" in err


def test_gc_dry_run_then_real(published, capsys):
    url, _ = published
    code, out, _ = run(capsys, "gc", url, "--keep-last", "1", "--json")
    assert code == 0 and json.loads(out)["deleted_versions"] == []  # 2 needs its chain 0 and 1
    code, out, _ = run(capsys, "gc", url, "--keep-last", "1", "--grace", "0", "--dry-run")
    assert "would delete 0 version(s)" in out
    assert Stream(url).versions() == [0, 1, 2]


def test_console_script_help_and_storage_options(tmp_path, s3_endpoint):
    help_text = subprocess.run([sys.executable, "-m", "ckptstream.cli", "ls", "--help"], capture_output=True,
                               text=True, check=True).stdout
    assert "examples:" in help_text and "exit codes:" in help_text and "--json" in help_text
    # S3 configured only through --storage-option (no AWS_ENDPOINT_URL in the environment).
    from tests.helpers import new_bucket

    bucket = new_bucket(s3_endpoint)
    model = write_tiny_model(tmp_path / "m", TinyModelSpec(arch="qwen3"))
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    url = f"s3://{bucket}/s"
    options = ["-o", json.dumps({"endpoint_url": s3_endpoint}).join(["client_kwargs=", ""])]
    result = subprocess.run(["ckptstream", "publish", url, "--from-hf", str(model), "--cache-dir", "", *options],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    result = subprocess.run(["ckptstream", "verify", url, *options], capture_output=True, text=True, env=env)
    assert result.returncode == 0 and "version 0: ok" in result.stdout
    # (botocore's own retries of the refused connection would take 12 s: AWS_MAX_ATTEMPTS, the AWS way, ends them)
    result = subprocess.run(["ckptstream", "verify", url], capture_output=True, text=True,
                            env={**env, "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_MAX_ATTEMPTS": "1"})
    assert result.returncode != 0 and result.stderr.startswith("Error:") and "Traceback" not in result.stderr


def test_make_tiny_model_sizes(tmp_path, capsys):
    code, out, _ = run(capsys, "make-tiny-model", str(tmp_path / "t"), "--arch", "llama", "--size", "8MB",
                       "--shard-size", "2MB", "--json")
    info = json.loads(out)
    assert code == 0 and 6e6 < info["bytes"] < 11e6 and info["tie_embeddings"]
    assert (tmp_path / "t" / "model.safetensors.index.json").exists()
    assert "lm_head.weight" not in dict(iter_hf_weights(tmp_path / "t"))


def test_make_tiny_adapter_then_a_step_publishes_an_adapter_stream(tmp_path, capsys):
    base, adapter, url = str(tmp_path / "base"), str(tmp_path / "adapter"), str(tmp_path / "lora")
    assert run(capsys, "make-tiny-model", base)[0] == 0
    code, out, _ = run(capsys, "make-tiny-adapter", base, adapter, "--rank", "4", "--json")
    assert code == 0 and json.loads(out)["rank"] == 4
    assert run(capsys, "publish", url, "--from-peft", adapter)[0] == 0
    code, out, _ = run(capsys, "make-tiny-adapter", base, adapter, "--step", "1", "--json")
    assert code == 0 and json.loads(out)["changed_elements"] > 0
    assert run(capsys, "publish", url, "--from-peft", adapter)[0] == 0
    info = Stream(url).info()
    assert (info.kind, info.adapter.rank, Stream(url).manifest(1).kind) == ("adapter", 4, "delta")


def test_make_tiny_adapter_without_peft_names_the_extra(tmp_path, capsys, monkeypatch):
    base = str(tmp_path / "base")
    assert run(capsys, "make-tiny-model", base)[0] == 0
    monkeypatch.setitem(sys.modules, "peft", None)  # what `import peft` finds where it is not installed
    code, _, err = run(capsys, "make-tiny-adapter", base, str(tmp_path / "adapter"))
    assert code == 1 and "needs peft, which is not installed. pip install 'ckptstream[lora]'" in err
    assert not (tmp_path / "adapter").exists()


def test_publish_default_cache_dir_is_under_home(tmp_path, monkeypatch, capsys):
    """The default --cache-dir (~/.cache/ckptstream/publish) is expanded, not created as a literal ``~``."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("CKPTSTREAM_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    model = write_tiny_model(tmp_path / "model", TinyModelSpec())
    assert run(capsys, "publish", str(tmp_path / "stream"), "--from-hf", str(model))[0] == 0
    assert list((tmp_path / "home" / ".cache" / "ckptstream" / "publish").glob("*.safetensors"))
    assert not (tmp_path / "~").exists()


# ------------------------------------------------------------------ expected bad input: usage errors, not exit 1

@pytest.fixture
def one_version(tmp_path, tiny_model, capsys):
    """A local stream with version 0, published with the CLI."""
    url = str(tmp_path / "stream")
    assert run(capsys, "publish", url, "--from-hf", str(tiny_model), "--cache-dir", "")[0] == 0
    return url


@pytest.mark.parametrize("bad", ["abc", "-1"])
@pytest.mark.parametrize("command", ["show", "materialize", "diff", "verify"])
def test_bad_version_is_a_usage_error(one_version, tmp_path, capsys, command, bad):
    argv = {"show": ["show", one_version, bad], "materialize": ["materialize", one_version, bad, str(tmp_path / "o")],
            "diff": ["diff", one_version, "0", bad], "verify": ["verify", one_version, bad]}[command]
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.splitlines()[-1].startswith("Error: ") and repr(bad) in err and "'latest'" in err
    assert not (tmp_path / "o").exists()


def test_bad_version_options_are_usage_errors(one_version, tiny_model, capsys):
    code, _, err = run(capsys, "publish", one_version, "--from-hf", str(tiny_model), "--version", "-1")
    assert code == 2 and "Error: argument --version" in err
    code, _, err = run(capsys, "follow", one_version, "--vllm-url", "http://127.0.0.1:9", "--pin", "x")
    assert code == 2 and "Error: argument --pin" in err
    code, _, err = run(capsys, "serve", one_version, "--version", "abc")
    assert code == 2 and "Error: argument --version" in err


def test_gc_keep_last_must_be_positive(one_version, capsys):
    code, out, err = run(capsys, "gc", one_version, "--keep-last", "0")
    assert code == 2 and out == "" and "Error: argument --keep-last: 0 is not a positive count" in err
    assert Stream(one_version).versions() == [0]


def test_publish_keyframe_every_must_be_positive(one_version, tiny_model, capsys):
    code, _, err = run(capsys, "publish", one_version, "--from-hf", str(tiny_model), "--keyframe-every", "0")
    assert code == 2 and "Error: argument --keyframe-every: 0 is not a positive count" in err
    assert Stream(one_version).versions() == [0]


def test_storage_option_without_value_is_a_usage_error(one_version, capsys):
    code, out, err = run(capsys, "ls", one_version, "-o", "novalue")
    assert code == 2 and out == ""
    assert "Error: argument --storage-option/-o: wants KEY=VALUE, got 'novalue'" in err


def test_materialize_onto_an_existing_file_is_a_usage_error(one_version, tmp_path, capsys):
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"keep me")
    for extra in ([], ["--force"]):
        code, out, err = run(capsys, "materialize", one_version, "latest", str(target), *extra)
        assert code == 2 and out == "" and err.startswith("Error: ") and "is a file, not a directory" in err
        assert target.read_bytes() == b"keep me"


def test_unknown_url_scheme_is_incompatible(capsys):
    code, out, err = run(capsys, "ls", "nosuchscheme://bucket/run1")
    assert code == 6 and out == ""
    assert err.startswith("Error: ") and "nosuchscheme" in err and "Traceback" not in err


def test_parser_and_help_do_not_import_torch():
    """`ckptstream --help` (and every command's) stays fast: building the parser imports no torch."""
    commands = ["publish", "ls", "show", "diff", "replicas", "materialize", "verify", "gc", "follow", "serve",
                "replay", "make-tiny-model", "demo"]
    check = ("import contextlib, io, sys\n"
             "from ckptstream.cli import main\n"
             f"for argv in [['--help'], ['--version']] + [[c, '--help'] for c in {commands!r}]:\n"
             "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
             "        try:\n"
             "            code = main(argv)\n"
             "        except SystemExit as exc:\n"
             "            code = exc.code\n"
             "    assert code == 0, argv\n"
             "    assert argv[0] == '--version' or 'exit codes:' in out.getvalue(), argv\n"
             "assert 'torch' not in sys.modules, 'torch imported'\n")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("spec", "code"), [("abc", 2), ("0:1:x", 2), ("0:1:0", 2), (":1", 2), ("5:9", 4)])
def test_bad_replay_versions_are_refused_before_any_server_is_touched(one_version, capsys, spec, code):
    """Nothing listens at the vLLM URL: the selection is refused first, with its own exit code."""
    got, out, err = run(capsys, "replay", one_version, "--versions", spec, "--vllm-url", "http://127.0.0.1:9",
                        "--", "true")
    assert got == code and out == "" and err.splitlines()[-1].startswith("Error: ")


def test_replay_needs_a_command(one_version, capsys):
    got, _, err = run(capsys, "replay", one_version, "--versions", "0", "--vllm-url", "http://127.0.0.1:9")
    assert got == 2 and "after --" in err


@pytest.mark.parametrize("size", ["infGB", "-1MB", "nan"])
def test_a_size_must_be_a_finite_byte_count(tmp_path, capsys, size):
    code, out, err = run(capsys, "make-tiny-model", str(tmp_path / "m"), f"--size={size}")
    assert code == 2 and out == "" and "is not a size" in err

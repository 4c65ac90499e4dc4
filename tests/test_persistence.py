"""Contract 5 end to end: a store written by one process serves another, bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from helpers import essay_paragraphs, tiny_model, tiny_tokenizer

from kvboost_rag import KVBoostEngine

PREFIX = "Answer from the documents below.\n\n"
QUESTION = "\n\nQuestion: what is this about?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvboost_rag.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)


def model_and_store(model_dir, store) -> list[str]:
    """The CLI options every command here shares: the tiny model in float32, and the store."""
    return ["--model", str(model_dir), "--dtype", "float32", "--store", str(store)]


def cold_reference(model_dir, prompt):
    engine = KVBoostEngine.from_pretrained(str(model_dir), dtype="float32", reuse="off")
    return engine.generate(prompt, max_new_tokens=8, return_logits=True)


def test_prewarm_in_one_process_then_documents_come_from_disk_in_another(model_dir, tmp_path):
    docs = essay_paragraphs(3, max_chars=600)
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, d in enumerate(docs):
        (folder / f"{i}.txt").write_text(d)
    store = tmp_path / "store"
    prewarm = ["prewarm", str(folder), *model_and_store(model_dir, store)]
    done = cli(*prewarm, "--prefix", PREFIX, "--quiet")
    assert done.returncode == 0, done.stderr
    assert "prewarmed 3 documents for flat prompts (0 already stored)" in done.stdout

    prompt = PREFIX + docs[1] + QUESTION
    with KVBoostEngine.from_pretrained(str(model_dir), dtype="float32", store_dir=str(store)) as engine:
        r = engine.generate(prompt, max_new_tokens=8, return_logits=True)
        doc_tokens = len(engine.canonicalize(PREFIX + docs[1]))
        chunk = engine.chunk_size
    # prefix and document, to within the chunk where the document ends: everything but the question
    assert (
        doc_tokens - chunk
        <= r.usage.cached_tokens_by_tier.get("disk", 0)
        == r.usage.cached_tokens
        <= doc_tokens
    )
    ref = cold_reference(model_dir, prompt)  # pre-warming changed nothing in the prompt's tokens
    assert torch.equal(r.first_logits, ref.first_logits) and r.token_ids == ref.token_ids

    again = cli(*prewarm, "--prefix", PREFIX, "--quiet")
    assert "(3 already stored)" in again.stdout, "a second run resumes by skipping stored documents"

    # Blend mode in a third process finds the later documents away from where they were pre-warmed.
    blended_prompt = PREFIX + docs[2] + "\n\n" + docs[0] + QUESTION
    options = [*model_and_store(model_dir, store), "--reuse", "blend", "--max-new-tokens", "4", "--json"]
    blended = cli("generate", "--raw", blended_prompt, *options)
    assert blended.returncode == 0, blended.stderr
    usage = json.loads(blended.stdout)["usage"]
    assert usage["cached_tokens"] > 0 and usage["approx_tokens"] > 0


def test_full_prompt_from_disk_in_a_fresh_process_is_bitwise_identical(model_dir, tmp_path):
    store = tmp_path / "store"
    prompt = PREFIX + essay_paragraphs(1)[0] + QUESTION
    first = cli(
        "generate", "--raw", prompt, *model_and_store(model_dir, store), "--max-new-tokens", "8", "--json"
    )
    assert first.returncode == 0, first.stderr
    written = json.loads(first.stdout)
    assert written["usage"]["stored_tokens"] == written["usage"]["prompt_tokens"]

    with KVBoostEngine.from_pretrained(str(model_dir), dtype="float32", store_dir=str(store)) as engine:
        r = engine.generate(prompt, max_new_tokens=8, return_logits=True)
    assert r.usage.cached_tokens_by_tier == {"disk": r.usage.prompt_tokens}
    assert r.usage.recomputed_tokens == 0
    assert r.text == written["text"]
    ref = cold_reference(model_dir, prompt)
    assert torch.equal(r.first_logits, ref.first_logits) and r.token_ids == ref.token_ids


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """The CLI in this process (fast); the tests above use real separate processes."""
    from kvboost_rag.cli import main

    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_stats_verify_gc_clear(model_dir, tmp_path, capsys):
    store = str(tmp_path / "store")
    model = ("--model", str(model_dir))
    prompt = PREFIX + "\n\n".join(essay_paragraphs(2, max_chars=700)) + QUESTION
    generate = ["generate", "--raw", prompt, *model, "--dtype", "float32", "--store", store]
    # --chunk-size 128: the prompt spans several chunks
    assert run_main(capsys, *generate, "--max-new-tokens", "2", "--json", "--chunk-size", "128")[0] == 0
    stats = json.loads(run_main(capsys, "stats", "--store", store, "--json")[1])
    assert stats["entries"] > 0 and stats["bytes"] > 0 and len(stats["namespaces"]) == 1

    code, out, _ = run_main(capsys, "verify", "--store", store, *model, "--dtype", "float32", "--sample", "2")
    assert code == 0 and "recomputed 2 entries: 0 differ bitwise" in out

    # entries of another dtype are another namespace; gc for float32 drops them
    assert (
        run_main(
            capsys,
            "generate",
            "--raw",
            prompt,
            *model,
            "--dtype",
            "bfloat16",
            "--store",
            store,
            "--max-new-tokens",
            "1",
            "--json",
        )[0]
        == 0
    )
    assert len(json.loads(run_main(capsys, "stats", "--store", store, "--json")[1])["namespaces"]) == 2
    code, out, _ = run_main(capsys, "gc", "--store", store, *model, "--dtype", "float32")
    assert code == 0 and "dropped" in out
    assert len(json.loads(run_main(capsys, "stats", "--store", store, "--json")[1])["namespaces"]) == 1

    # a corrupt payload makes verify fail and removes it
    victim = next((tmp_path / "store" / "kv").rglob("*.val"))
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    code, out, _ = run_main(capsys, "verify", "--store", store)
    assert code == 1 and "1 corrupt" in out

    assert run_main(capsys, "clear", "--store", store, "--yes")[0] == 0
    assert json.loads(run_main(capsys, "stats", "--store", store, "--json")[1])["entries"] == 0


def test_cli_errors_have_exit_codes(tmp_path, capsys):
    assert run_main(capsys, "generate", "hi", "--model", str(tmp_path / "nope"))[0] == 3
    assert run_main(capsys, "stats", "--store", str(tmp_path / "missing"))[0] == 4
    code, _, err = run_main(
        capsys, "prewarm", str(tmp_path / "nothing-*.txt"), "--store", str(tmp_path / "s")
    )
    assert code == 2 and "not a folder" in err


def prewarmed_document(model_dir, tmp_path, *flags: str) -> Callable[..., dict]:
    """Pre-warm one essay paragraph through the CLI with ``flags``; returns a function that asks about
    it through ``kvboost-rag generate`` (with further flags) and returns the usage."""
    doc = essay_paragraphs(1, max_chars=600)[0]
    (tmp_path / "doc.txt").write_text(doc)
    common = model_and_store(model_dir, tmp_path / "store")
    done = cli("prewarm", str(tmp_path / "doc.txt"), *common, "--prefix", PREFIX, *flags, "--quiet")
    assert done.returncode == 0, done.stderr

    def usage(*more: str) -> dict:
        out = cli(
            "generate", "--raw", PREFIX + doc + QUESTION, *common, "--max-new-tokens", "1", "--json", *more
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["usage"]

    return usage


def test_cli_prewarms_and_generates_for_one_tenant(model_dir, tmp_path):
    usage = prewarmed_document(model_dir, tmp_path, "--cache-salt", "t-a")
    assert usage("--cache-salt", "t-b")["cached_tokens"] == 0 and usage()["cached_tokens"] == 0
    assert usage("--cache-salt", "t-a")["cached_tokens"] > 0


def test_cli_store_codec_writes_approximate_entries_only_lossy_stores_serve(model_dir, tmp_path):
    usage = prewarmed_document(model_dir, tmp_path, "--store-codec", "int8")
    lossy = usage("--store-codec", "int8")
    assert lossy["approx_tokens"] > 0 and lossy["cached_tokens"] == 0
    exact = usage()  # a raw store never serves the int8 entries
    assert exact["approx_tokens"] == 0 and exact["cached_tokens"] == 0
    common = model_and_store(model_dir, tmp_path / "store")
    bad = cli("generate", "--raw", "hi", *common, "--store-codec", "int3")
    assert bad.returncode != 0 and "int4" in bad.stderr


SYSTEM = "Answer from the documents."


@pytest.mark.parametrize("system", [SYSTEM, None], ids=["system", "no-system"])
def test_cli_prewarms_for_chat_requests_as_the_template_renders_them(model_dir, tmp_path, capsys, system):
    doc = essay_paragraphs(1, max_chars=600)[0]
    (tmp_path / "doc.txt").write_text(doc)
    common = model_and_store(model_dir, tmp_path / "store")
    form = ["--system", system] if system is not None else ["--chat"]
    code, out, err = run_main(capsys, "prewarm", str(tmp_path / "doc.txt"), *common, *form, "--quiet")
    assert code == 0, err
    assert "for chat requests" in out
    asked = ["--system", system] if system is not None else []
    code, out, err = run_main(
        capsys, "generate", doc + QUESTION, *common, *asked, "--max-new-tokens", "1", "--json"
    )
    assert code == 0, err
    cached = json.loads(out)["usage"]["cached_tokens"]
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": doc + QUESTION})
    with KVBoostEngine.from_pretrained(str(model_dir), dtype="float32") as engine:
        prompt = engine.canonicalize(messages)
        chunk = engine.chunk_size
    doc_end = next(
        end for s, (_, end) in zip(prompt.segments, prompt.segment_spans, strict=True) if s.text == doc
    )
    # the template's text and the document, to within the chunk where the document ends
    assert doc_end - chunk <= cached <= doc_end


def test_cli_reports_a_damaged_store_then_repairs_or_clears_it(model_dir, tmp_path, capsys):
    store = tmp_path / "store"
    common = model_and_store(model_dir, store)
    prompt = PREFIX + essay_paragraphs(1, max_chars=600)[0] + QUESTION
    assert run_main(capsys, "generate", "--raw", prompt, *common, "--max-new-tokens", "1", "--json")[0] == 0
    entries = json.loads(run_main(capsys, "stats", "--store", str(store), "--json")[1])["entries"]
    (store / "kv" / "cache.db").write_bytes(b"garbage" * 1000)
    for command in (["stats", "--store", str(store)], ["verify", "--store", str(store)]):
        code, _, err = run_main(capsys, *command)
        assert code == 4 and "damaged" in err and "kvboost-rag repair" in err and "Traceback" not in err
    code, out, err = run_main(capsys, "repair", "--store", str(store))
    assert code == 0, err
    assert "set aside and rebuilt: kv/cache.db" in out and f"stored again: {entries}" in out
    assert json.loads(run_main(capsys, "stats", "--store", str(store), "--json")[1])["entries"] == entries
    (store / "index.sqlite").write_bytes(b"garbage" * 1000)
    assert run_main(capsys, "clear", "--store", str(store), "--yes")[0] == 0  # works on a damaged store
    assert json.loads(run_main(capsys, "stats", "--store", str(store), "--json")[1])["entries"] == 0


def test_cli_signs_the_store_with_a_secret_from_a_file_or_the_environment(
    model_dir, tmp_path, capsys, monkeypatch
):
    store = tmp_path / "store"
    common = model_and_store(model_dir, store)
    secret_file = tmp_path / "secret"
    secret_file.write_text("a store secret of 32 characters.\n")
    prompt = PREFIX + essay_paragraphs(1, max_chars=600)[0] + QUESTION
    ask = ["generate", "--raw", prompt, *common, "--max-new-tokens", "1", "--json"]
    assert run_main(capsys, *ask, "--store-secret-file", str(secret_file))[0] == 0
    assert next((store / "kv").rglob("*.val")).read_bytes()[:4] == b"KVS2"
    assert (store.stat().st_mode & 0o777) == 0o700
    monkeypatch.setenv("KVBOOST_STORE_SECRET", "a store secret of 32 characters.")
    code, out, _ = run_main(capsys, *ask)
    assert code == 0 and json.loads(out)["usage"]["cached_tokens"] > 0
    code, out, _ = run_main(capsys, "verify", "--store", str(store))
    assert code == 0 and "0 corrupt" in out
    monkeypatch.setenv("KVBOOST_STORE_SECRET", "another secret of 32 characters.")
    code, out, _ = run_main(capsys, "verify", "--store", str(store))
    assert code == 0 and "0 corrupt" in out and " 0 foreign" not in out  # signed otherwise: kept
    monkeypatch.setenv("KVBOOST_STORE_SECRET", "a store secret of 32 characters.")
    code, out, _ = run_main(capsys, *ask)
    assert code == 0 and json.loads(out)["usage"]["cached_tokens"] > 0  # nothing was removed
    monkeypatch.setenv("KVBOOST_STORE_SECRET", "another secret of 32 characters.")
    monkeypatch.setenv("KVBOOST_STORE_PREVIOUS_SECRETS", "a store secret of 32 characters.")
    code, out, _ = run_main(capsys, *ask)  # rotating: the old secret's entries are read
    assert code == 0 and json.loads(out)["usage"]["cached_tokens"] > 0


def test_engines_under_different_secrets_share_a_store_without_removing_each_others_entries(tmp_path):
    from kvboost_rag import EngineConfig

    model, tok = tiny_model("llama"), tiny_tokenizer()
    doc = essay_paragraphs(1, max_chars=600)[0]
    prompt = PREFIX + doc + QUESTION

    def engine(secret: str | None) -> KVBoostEngine:
        config = EngineConfig(chunk_size=16, store_secret=secret)
        return KVBoostEngine(model, tok, config=config, store_dir=tmp_path)

    def ask(secret: str | None) -> int:
        with engine(secret) as e:
            usage = e.generate(prompt, max_new_tokens=2).usage
            assert e.stats()["disk"]["extra"]["corrupt"] == 0
            return usage.cached_tokens_by_tier.get("disk", 0)

    a, b = "secret A of at least 16 bytes", "secret B of at least 16 bytes"
    with engine(a) as e:
        e.prewarm([doc], prefix=PREFIX)  # A pre-warms the document
    assert ask(b) == 0  # B cannot trust A's entries: misses, and nothing removed
    assert ask(None) == 0  # nor can a reader without a secret
    document_tokens = len(KVBoostEngine(model, tok).canonicalize(PREFIX + doc).token_ids)
    assert ask(a) >= document_tokens - 16  # A reads its pre-warmed document again

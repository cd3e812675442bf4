"""`python -m benchmarks.grammar_eval`: xgrammar against llguidance on what kvtier needs from a
grammar engine (the choice is in docs/serving.md, Structured outputs).

For four tokenizers — the tiny test models' byte tokenizer, the embedded model's, and byte-level
BPE vocabularies of 32k and 151k tokens built here from the standard library's sources (the
sizes of Llama-2's and Qwen2's; no hub) — it measures: building each library's tokenizer view,
compiling a few JSON schemas, and the CPU time to fill one token's mask while a fixed JSON
document is fed token by token (mean and worst, µs). It checks: a rollback over the document
restores the masks, JSON-schema features compile (or are refused), and whether a raw control
byte may appear inside a JSON string (invalid JSON). Prints a table, saves JSON. Asserts nothing;
timings on a shared machine are noisy, ratios within one run are what to read. Needs xgrammar
beside kvtier's llguidance (`pip install xgrammar`; it is no kvtier dependency).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import main
from kvtier.bench import save_json

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "nested-anyof": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer", "minimum": 0, "maximum": 10_000},
                        "v": {
                            "anyOf": [{"type": "string", "pattern": "^[a-z]+$"}, {"type": "null"}]
                        },
                        "tags": {
                            "type": "array",
                            "items": {"enum": ["x", "y", "z"]},
                            "maxItems": 3,
                        },
                    },
                    "required": ["id", "v"],
                },
                "minItems": 1,
                "maxItems": 8,
            }
        },
        "required": ["items"],
    },
    "enum-500": {"enum": [f"option number {i}" for i in range(500)]},
}
DOCUMENT = {"items": [{"id": 17, "v": "abc", "tags": ["x", "z"]}, {"id": 4096, "v": None}]}
FEATURES: dict[str, dict[str, Any]] = {
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}]},
    "pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "min/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "minimum/maximum": {"type": "integer", "minimum": -3, "maximum": 99},
    "exclusiveMinimum": {"type": "number", "exclusiveMinimum": 0},
    "multipleOf": {"type": "number", "multipleOf": 0.25},
    "min/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
    "enum": {"enum": ["a", 1, None]},
    "const": {"const": "fixed"},
    "$ref/$defs": {
        "$defs": {"n": {"type": "integer"}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/n"}},
    },
    "recursive $ref": {
        "$defs": {
            "t": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}},
            }
        },
        "$ref": "#/$defs/t",
    },
    "format date-time": {"type": "string", "format": "date-time"},
    "format email": {"type": "string", "format": "email"},
    "patternProperties": {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}},
    "if/then/else": {"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {"type": "string"}},
    "not": {"not": {"type": "string"}},
    "minProperties": {"type": "object", "minProperties": 1},
}
# A document each feature must refuse: a library that compiles the feature but accepts this
# ignored it (worse than refusing it: the output may break the schema)
VIOLATIONS: dict[str, str] = {
    "anyOf": "true",
    "oneOf": '"s"',
    "pattern": '"ab-123"',
    "min/maxLength": '"abcdefg"',
    "minimum/maximum": "100",
    "exclusiveMinimum": "0",
    "multipleOf": "0.3",
    "min/maxItems": "[1, 2, 3, 4]",
    "uniqueItems": "[1, 1]",
    "prefixItems": '["a", 1]',
    "enum": '"b"',
    "const": '"other"',
    "format date-time": '"yesterday"',
    "format email": '"nobody"',
    "if/then/else": "-1",
    "not": '"s"',
    "minProperties": "{}",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=[32_000, 151_646])
    parser.add_argument("--repeats", type=int, default=3, help="passes over the document")
    parser.add_argument("--out", default=f"results/grammar_eval_{time.strftime('%Y%m%d')}.json")


def synthetic_tokenizer(size: int, work: Path) -> Path:
    """A byte-level BPE tokenizer.json of `size` tokens (the 256 bytes, then words, subwords and
    punctuation runs of the standard library's sources, with and without a leading space)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from kvtier.model.testing import _bytes_to_unicode

    table = _bytes_to_unicode()

    def enc(s: str) -> str:
        return "".join(table[b] for b in s.encode())

    vocab: dict[str, int] = {}
    for b in range(256):
        vocab.setdefault(table[b], len(vocab))
    seen = set(vocab)
    for file in sorted(Path(json.__file__).parent.parent.rglob("*.py")):
        for word in re.findall(
            r"[A-Za-z_]+|[0-9]+|[^\sA-Za-z0-9]+", file.read_text(errors="replace")
        ):
            for piece in (word, " " + word, word[: len(word) // 2], word[len(word) // 2 :]):
                t = enc(piece)
                if len(piece) > 1 and t not in seen:
                    seen.add(t)
                    vocab[t] = len(vocab)
                    if len(vocab) >= size - 1:
                        break
            if len(vocab) >= size - 1:
                break
        if len(vocab) >= size - 1:
            break
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    folder = work / f"bpe{size}"
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok: Any, vocab: int, eos: int) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgr
        hf = PreTrainedTokenizerFast(tokenizer_object=tok.tokenizer)  # type: ignore[no-untyped-call]
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.vocab = vocab

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any, mask: Any) -> None:
        m.fill_next_token_bitmask(mask, 0)

    def accept(self, m: Any, t: int) -> bool:
        return bool(m.accept_token(t))

    def rollback(self, m: Any, n: int) -> None:
        m.rollback(n)

    def accepts_whole(self, m: Any, ids: list[int], eos: int) -> bool:
        return all(m.accept_token(t) for t in ids) and bool(m.accept_token(eos))


class Llguidance:
    name = "llguidance"

    def __init__(self, tok: Any, vocab: int, eos: int) -> None:
        import llguidance

        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(tok.tokenizer.to_str(), n_vocab=vocab, eos_token=eos)
        self.vocab = vocab

    def compile(self, schema: dict[str, Any]) -> Any:
        make = self.llg.LLMatcher
        opts: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        m = make(self.tok, make.grammar_from_json_schema(json.dumps(schema), defaults=opts))
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, m: Any, mask: Any) -> None:
        view = mask[0]
        m.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * 4)

    def accept(self, m: Any, t: int) -> bool:
        return bool(m.consume_token(t))

    def rollback(self, m: Any, n: int) -> None:
        m.rollback(n)

    def accepts_whole(self, m: Any, ids: list[int], eos: int) -> bool:
        return bool(m.consume_tokens(ids)) and bool(m.is_accepting())


def measure(lib: Any, tok: Any, repeats: int) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"compile_ms": {}}
    compiled = {}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        compiled[name] = lib.compile(schema)
        out["compile_ms"][name] = round((time.perf_counter() - t0) * 1e3, 3)
    ids = tok.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    mask = torch.full((1, -(-lib.vocab // 32)), -1, dtype=torch.int32)
    times: list[float] = []
    masks_ok = True
    for _ in range(repeats):
        m = lib.matcher(compiled["nested-anyof"])
        first: list[Any] = []
        for t in ids:
            t0 = time.perf_counter()
            lib.fill(m, mask)
            times.append(time.perf_counter() - t0)
            first.append(mask.clone())
            if not lib.accept(m, t):
                raise AssertionError(f"{lib.name} refused token {t} of the document")
        lib.rollback(m, len(ids) // 2)  # back to the middle: the masks must repeat
        for i in range(len(ids) - len(ids) // 2, len(ids)):
            lib.fill(m, mask)
            masks_ok &= bool(torch.equal(mask, first[i]))
            lib.accept(m, ids[i])
    out["document_tokens"] = len(ids)
    out["mask_fill_us_mean"] = round(sum(times) / len(times) * 1e6, 2)
    out["mask_fill_us_max"] = round(max(times) * 1e6, 2)
    out["rollback_restores_masks"] = masks_ok
    out["features"] = {}
    eos = tok.eos_token_id
    for name, schema in FEATURES.items():
        try:
            compiled = lib.compile(schema)
        except Exception as exc:
            out["features"][name] = f"refused: {str(exc).strip().splitlines()[-1][:100]}"
            continue
        bad = VIOLATIONS.get(name)
        ids = tok.encode(bad, add_special_tokens=False) if bad else []
        if bad and lib.accepts_whole(lib.matcher(compiled), ids, eos):
            out["features"][name] = f"IGNORED: accepts {bad}"
        else:
            out["features"][name] = "enforced" if bad else "compiles"
    out["raw_control_byte_in_string"] = control_byte_allowed(lib, tok)
    return out


def control_byte_allowed(lib: Any, tok: Any) -> bool | None:
    """Whether the mask inside a JSON string allows a token that is a raw control byte (0x01):
    JSON forbids one unescaped; None when the vocabulary has no such token."""
    import torch

    vocab = tok.tokenizer.get_vocab()
    from kvtier.model.testing import _bytes_to_unicode

    ctrl = vocab.get(_bytes_to_unicode()[1])
    if ctrl is None:
        return None
    m = lib.matcher(lib.compile({"type": "string", "maxLength": 6}))
    lib.accept(m, tok.encode('"', add_special_tokens=False)[0])
    mask = torch.full((1, -(-lib.vocab // 32)), -1, dtype=torch.int32)
    lib.fill(m, mask)
    return bool((int(mask[0, ctrl // 32]) >> (ctrl % 32)) & 1)


def run(args: argparse.Namespace) -> int:
    import tempfile

    from kvtier.engine.params import DEFAULT_MODEL
    from kvtier.model.testing import write_tiny_model
    from kvtier.model.tokenizer import load_tokenizer

    work = Path(tempfile.mkdtemp(prefix="grammar-eval-"))
    folders = {"tiny-byte": write_tiny_model(work / "tiny", "llama"), "embedded": DEFAULT_MODEL}
    for size in args.vocab_sizes:
        folders[f"bpe-{size // 1000}k"] = synthetic_tokenizer(size, work)
    results: dict[str, Any] = {}
    for label, folder in folders.items():
        tok = load_tokenizer(folder)
        vocab = tok.vocab_size
        eos = tok.eos_token_id
        assert eos is not None
        for cls in (Xgrammar, Llguidance):
            t0 = time.perf_counter()
            lib = cls(tok, vocab, eos)
            setup = round((time.perf_counter() - t0) * 1e3, 1)
            r = {"vocab": vocab, "tokenizer_setup_ms": setup} | measure(lib, tok, args.repeats)
            results[f"{label}/{cls.name}"] = r
            print(
                f"{label:>10} {cls.name:>10} vocab {vocab:>7}  setup {setup:8.1f} ms  compile ms "
                f"{r['compile_ms']}  mask µs mean {r['mask_fill_us_mean']:8.1f} max "
                f"{r['mask_fill_us_max']:9.1f}  rollback ok {r['rollback_restores_masks']}  "
                f"ctrl byte in string {r['raw_control_byte_in_string']}"
            )
    for label in ("xgrammar", "llguidance"):
        feats = results[f"embedded/{label}"]["features"]
        good = [k for k, v in feats.items() if v in ("enforced", "compiles")]
        bad = {k: v for k, v in feats.items() if k not in good}
        print(f"{label}: {len(good)}/{len(feats)} schema features enforced; others {bad}")
    from importlib.metadata import version

    versions = {mod: version(mod) for mod in ("xgrammar", "llguidance")}
    config = {k: v for k, v in vars(args).items() if k not in ("func", "bench")}
    path = save_json({"config": config, "versions": versions, "results": results}, args.out)
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))

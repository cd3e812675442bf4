"""Grammar-constrained decoding over xgrammar (why xgrammar: docs/serving.md §Structured outputs):
the compiled grammars of one tokenizer, cached by spec, and the per-request matcher that says
which tokens may come next.

`Grammars.compile` is the boundary: a spec it cannot compile (bad schema or regex, too large, too
slow) is a ValueError naming the problem, raised before a request is queued. `Matcher` is runner
state: it advances on the tokens a forward op accepted and never on an unverified draft
(architecture.md §Grammar). Nothing here schedules or knows a request.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from kvtier.config import StructuredOutputsConfig
from kvtier.model.tokenizer import Tokenizer
from kvtier.sampling import GrammarSpec

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; a 400 shows the rest
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")
# How many compiles may run at once; one abandoned past its timeout keeps its slot until done.
MAX_CONCURRENT_COMPILES = 2
INSTALL_HINT = "structured outputs need xgrammar: pip install 'kvtier[structured]'"


class Grammars:
    """Compiles `GrammarSpec`s for one tokenizer and vocabulary (the model's logits width; ids
    past the tokenizer's are never allowed) and keeps the last `cache_size` compiled, and the
    specs that failed, by (kind, spec). Thread-safe: the engine thread compiles when a request
    is added, the compute worker looks them up when it builds a matcher."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        config: StructuredOutputsConfig | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.config = config or StructuredOutputsConfig()
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()  # compiled, or the error
        self._compiler: Any = None
        self._slots = threading.Semaphore(MAX_CONCURRENT_COMPILES)
        self._held: dict[GrammarSpec, int] = {}  # specs of live requests: never evicted
        self.num_compiles = 0  # compiles started (cache misses)

    def hold(self, spec: GrammarSpec) -> None:
        """Keep `spec`'s compiled grammar cached while a request uses it (its matcher may be
        rebuilt after a preemption); pairs with `release`."""
        with self._lock:
            self._held[spec] = self._held.get(spec, 0) + 1

    def release(self, spec: GrammarSpec) -> None:
        with self._lock:
            n = self._held.pop(spec, 0) - 1
            if n > 0:
                self._held[spec] = n
            self._evict()

    def _evict(self) -> None:
        """Drop the least recently used grammars no live request holds, down to the bound."""
        excess = len(self._cache) - self.config.structured_outputs_cache_size
        for spec in [s for s in self._cache if s not in self._held][: max(excess, 0)]:
            del self._cache[spec]

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def _xgr_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                    from transformers import PreTrainedTokenizerFast
                except ImportError:
                    raise ValueError(INSTALL_HINT) from None
                hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.tokenizer)  # type: ignore[no-untyped-call]
                info = xgr.TokenizerInfo.from_huggingface(
                    hf, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                # our own cache bounds entries and remembers failures: xgrammar's stays off
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of `spec` (an xgrammar `CompiledGrammar`); ValueError naming the
        problem when it is too large, does not compile, or compiles too slowly."""
        cfg = self.config
        size = len(spec.spec.encode())
        if size > cfg.structured_outputs_max_spec_bytes:
            raise ValueError(
                f"the {_what(spec)} is {size} bytes, over the limit of "
                f"{cfg.structured_outputs_max_spec_bytes} (--structured-outputs-max-spec-bytes); "
                "send a smaller one"
            )
        with self._lock:
            got = self._cache.get(spec)
            if got is not None:
                self._cache.move_to_end(spec)
        if got is None:
            got = self._compile_bounded(spec)
            with self._lock:
                self._cache[spec] = got
                self._evict()
        if isinstance(got, ValueError):
            raise ValueError(str(got))
        return got

    def _compile_bounded(self, spec: GrammarSpec) -> Any:
        """Compile on a daemon thread and wait at most the timeout; the compiled grammar, or the
        ValueError to raise (kept in the cache like a grammar, so a bad spec costs one compile)."""
        compiler = self._xgr_compiler()
        timeout = self.config.structured_outputs_compile_timeout_s
        if not self._slots.acquire(timeout=timeout):
            return ValueError(
                f"the {_what(spec)} could not start compiling within {timeout:g} s: earlier "
                "grammars are still compiling past their time limit; retry later"
            )
        done = threading.Event()
        box: list[Any] = []

        def run() -> None:
            try:
                box.append(_compile(compiler, spec))
            except Exception as exc:  # xgrammar raises RuntimeError and others on bad specs
                box.append(ValueError(f"the {_what(spec)} does not compile: {_clean(exc)}"))
            finally:
                self._slots.release()
                done.set()

        self.num_compiles += 1
        threading.Thread(target=run, name="grammar-compile", daemon=True).start()
        if not done.wait(timeout):
            return ValueError(
                f"the {_what(spec)} took longer than {timeout:g} s to compile "
                "(--structured-outputs-compile-timeout-s); simplify it"
            )
        return box[0]

    def matcher(self, spec: GrammarSpec, output_ids: Sequence[int]) -> Matcher:
        """A matcher for `spec` that has accepted `output_ids` (a resumed request's outputs)."""
        m = Matcher(self.compile(spec))
        for t in output_ids:
            m.accept(t)
        return m

    def allocate_mask(self, num_rows: int) -> torch.Tensor:
        """[num_rows, ceil(vocab / 32)] int32 bitmask, every token allowed."""
        return torch.full((num_rows, -(-self.vocab_size // 32)), -1, dtype=torch.int32)


class Matcher:
    """One request's place in its grammar. Tokens after the grammar has ended (a request that
    ignores EOS) or after a token it refuses (another filter left the grammar no token) are
    free: not constrained, counted so a rollback undoes them first."""

    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self._m = xgr.GrammarMatcher(compiled)
        self.num_free = 0  # tokens accepted unconstrained, after the grammar's

    @property
    def constrained(self) -> bool:
        return self.num_free == 0 and not self._m.is_terminated()

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (nothing changed) if the grammar refuses it. Unconstrained,
        every token is accepted."""
        if not self.constrained:
            self.num_free += 1
            return True
        return bool(self._m.accept_token(token))

    def accept_free(self, tokens: Sequence[int]) -> None:
        """Advance by tokens already drawn under this matcher's masks; a refused one (no token
        was left by the other filters) frees the rest."""
        for t in tokens:
            if not self.accept(t):
                self.num_free += 1

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        free = min(num_tokens, self.num_free)
        self.num_free -= free
        if num_tokens > free:
            self._m.rollback(num_tokens - free)

    def fill(self, mask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `mask[row]`; all of them when unconstrained."""
        if self.constrained:
            self._m.fill_next_token_bitmask(mask, row)
        else:
            mask[row].fill_(-1)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


def apply_mask(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, the logits of `rows` whose bit in `mask` (on logits' device, one
    row per logits row) is 0."""
    if logits.dtype in (torch.float32, torch.bfloat16, torch.float16):
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, mask, indices=rows)
        return
    vocab = logits.shape[-1]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    bits = (mask.index_select(0, index.to(mask.device))[:, :, None] >> shifts) & 1
    allowed = bits.reshape(len(rows), -1)[:, :vocab].bool().to(logits.device)
    sub = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, sub)


def _compile(compiler: Any, spec: GrammarSpec) -> Any:
    if spec.kind == "json":
        try:
            json.loads(spec.spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON ({exc})") from None
        return compiler.compile_json_schema(spec.spec, any_whitespace=False)
    if spec.kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.spec)
    if spec.kind == "choice":
        options = json.loads(spec.spec)
        # GBNF string literals take JSON's escapes
        return compiler.compile_grammar(
            "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)
        )
    if spec.kind == "grammar":
        return compiler.compile_grammar(spec.spec)
    raise ValueError(f"unknown structured output kind {spec.kind!r}")


def _clean(exc: BaseException) -> str:
    text = str(exc).strip()
    return _CPP_PREFIX.sub("", text).strip() or type(exc).__name__


def _what(spec: GrammarSpec) -> str:
    return {
        "json": "JSON schema (structured_outputs.json / response_format.json_schema)",
        "json_object": "JSON object grammar",
        "regex": "regex (structured_outputs.regex)",
        "choice": "choice list (structured_outputs.choice)",
        "grammar": "grammar (structured_outputs.grammar)",
    }[spec.kind]

"""Grammar-constrained decoding over llguidance (why llguidance: docs/serving.md, Structured
outputs): the compiled grammars of one tokenizer, cached by spec, and the per-request matcher
that says which tokens may come next.

`Grammars.compile` is the boundary: a spec it cannot compile (bad schema or regex, too large, too
slow) is a ValueError naming the problem, raised before a request is queued; `compile_async`
runs it on a worker so the engine thread never waits for a compile. `Matcher` is runner
state: it advances on the tokens a forward op accepted and never on an unverified draft
(architecture.md §Grammar). Nothing here schedules or knows a request.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from kvtier.config import StructuredOutputsConfig
from kvtier.model import native
from kvtier.model.tokenizer import Tokenizer
from kvtier.sampling import GrammarSpec

# How many compiles may run at once; one abandoned past its timeout keeps its slot until done.
MAX_CONCURRENT_COMPILES = 2
INSTALL_HINT = "structured outputs need llguidance (a kvtier dependency): pip install llguidance"
# JSON as json.dumps writes it: no free whitespace, so a model cannot stall in it, and the
# separators models saw most
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
log = logging.getLogger("kvtier.grammar")


class Grammars:
    """Compiles `GrammarSpec`s for one tokenizer and vocabulary (the model's logits width; ids
    past the tokenizer's are never allowed) and keeps the last `cache_size` compiled, and the
    specs that failed, by (kind, spec). Thread-safe: compiles run on workers (`compile_async`)
    or on the caller's thread, the compute worker looks them up when it builds a matcher."""

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
        self._lltok: Any = None
        self._executor: Any = None  # llguidance's thread pool for the masks of a step
        self._slots = threading.Semaphore(MAX_CONCURRENT_COMPILES)
        self._held: dict[GrammarSpec, int] = {}  # specs of live requests: never evicted
        self._compiling: dict[GrammarSpec, Future[None]] = {}  # `compile_async`s not yet done
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

    @property
    def num_held(self) -> int:
        """Specs held by `hold` (each counted once however many holders)."""
        with self._lock:
            return len(self._held)

    def _tokenizer(self) -> Any:
        """llguidance's view of the tokenizer (from its tokenizer.json), built once."""
        with self._lock:
            if self._lltok is None:
                try:
                    import llguidance
                except ImportError:
                    raise ValueError(INSTALL_HINT) from None
                self._lltok = llguidance.LLTokenizer(
                    self.tokenizer.tokenizer.to_str(),
                    n_vocab=self.vocab_size,
                    eos_token=self.stop_token_ids or None,
                )
            return self._lltok

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of `spec` (a fresh llguidance `LLMatcher`, copied for each
        request); ValueError naming the problem when it is too large, does not compile, or
        compiles too slowly."""
        self.check_size(spec)
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

    def check_size(self, spec: GrammarSpec) -> None:
        """ValueError if `spec` is over the size limit (checked before any compile)."""
        limit = self.config.structured_outputs_max_spec_bytes
        size = len(spec.spec.encode())
        if size > limit:
            raise ValueError(
                f"the {_what(spec)} is {size} bytes, over the limit of {limit} "
                "(--structured-outputs-max-spec-bytes); send a smaller one"
            )

    def compile_async(self, spec: GrammarSpec) -> Future[None]:
        """Start `compile(spec)` on a worker thread and return at once: the future is done (with
        None) once `compile(spec)` answers from the cache, with the grammar or its error; done
        already on a hit. Calls for a spec being compiled share its compile. ValueError at once
        for a spec over the size limit. `hold` the spec first if it must stay cached until used
        (the cache may evict it otherwise)."""
        self.check_size(spec)
        with self._lock:
            fut = self._compiling.get(spec)
            if fut is not None:
                return fut
            fut = Future()
            if spec in self._cache:
                fut.set_result(None)
                return fut
            self._compiling[spec] = fut

        def run() -> None:
            try:
                self.compile(spec)
            except ValueError:
                pass  # cached: the caller's `compile` raises it
            finally:
                with self._lock:
                    del self._compiling[spec]
                fut.set_result(None)

        threading.Thread(target=run, name="grammar-compile-async", daemon=True).start()
        return fut

    def _compile_bounded(self, spec: GrammarSpec) -> Any:
        """Compile on a daemon thread and wait at most the timeout; the compiled grammar, or the
        ValueError to raise (kept in the cache like a grammar, so a bad spec costs one compile)."""
        tokenizer = self._tokenizer()
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
                box.append(_compile(tokenizer, spec))
            except Exception as exc:  # llguidance reports bad specs as a matcher error
                box.append(ValueError(f"the {_what(spec)} does not compile: {exc}"))
            finally:
                self._slots.release()
                done.set()

        with self._lock:
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
        m = Matcher(self.compile(spec).deep_copy(), self.stop_token_ids)
        m.accept_free(output_ids)
        return m

    def prepare_masks(
        self, jobs: Sequence[tuple[Matcher, int, list[int]]], num_rows: int
    ) -> MaskFill | None:
        """The fill of the masks of `num_rows` sampled rows ([num_rows, ceil(vocab / 32)] int32
        bitmask, every token allowed but in the rows it returns): for each (matcher, first row,
        drafts), row first + j gets the mask after the first j drafts. Rows after a draft the
        grammar refuses stay open: verification stops at the refused draft (the token drawn
        there cannot equal it), so they are never accepted. None when no matcher is still
        constrained (nothing to mask). Everything in Python happens here, on the caller's
        thread; the fill's `run` is llguidance's parallel calls, off the GIL, and leaves the
        matchers as they were."""
        work = [(m.matcher, first, drafts) for m, first, drafts in jobs if m.constrained]
        if not work:
            return None
        mask = torch.full((num_rows, -(-self.vocab_size // 32)), -1, dtype=torch.int32)
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        rows = [first + j for _, first, drafts in work for j in range(len(drafts) + 1)]
        plain = [(m, first) for m, first, drafts in work if not drafts]
        drafting = [w for w in work if w[2]]
        return MaskFill(self._executor, mask, rows, plain, drafting)


class MaskFill:
    """One step's grammar masks, ready to fill: `run` makes only llguidance's calls, which
    release the GIL, so on a worker thread beside the forward it holds the GIL just to start
    and to return (every Python step of the fill taken on a worker is a wait of the forward's
    thread for the GIL, on a model whose forward is mostly Python)."""

    __slots__ = ("_drafting", "_executor", "_plain", "mask", "rows")

    def __init__(
        self,
        executor: Any,
        mask: torch.Tensor,
        rows: list[int],
        plain: list[tuple[Any, int]],
        drafting: list[tuple[Any, int, list[int]]],
    ) -> None:
        self._executor = executor
        self.mask, self.rows = mask, rows  # the bitmask, and the rows the grammars bind
        self._plain, self._drafting = plain, drafting

    def run(self) -> tuple[torch.Tensor, list[int]]:
        """Fill the masks; (mask, rows)."""
        # the executor's calls behind llguidance.torch's fill_next_token_bitmask_par*, whose
        # module would compile a torch kernel we do not use at import
        mask = self.mask
        ptr, row_bytes, num_rows = mask.data_ptr(), mask.shape[1] * 4, mask.shape[0]
        if self._plain:
            self._executor.unsafe_compute_mask_ptr(self._plain, ptr, row_bytes, num_rows)
        if self._drafting:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                self._drafting, ptr, row_bytes, num_rows
            )
        return mask, self.rows


class Matcher:
    """One request's place in its grammar. Tokens after the grammar has ended (its EOS, and what
    a request that ignores EOS draws after it) or after a token it refuses (another filter left
    the grammar no token) are free: not constrained, counted so a rollback undoes them first."""

    def __init__(self, matcher: Any, eos_ids: Sequence[int]) -> None:
        self._m = matcher
        self._eos = frozenset(eos_ids)
        self.num_free = 0  # tokens accepted unconstrained, after the grammar's

    @property
    def constrained(self) -> bool:
        return self.num_free == 0 and not self._m.is_error()

    @property
    def matcher(self) -> Any:
        """The llguidance matcher (for `Grammars.prepare_masks`)."""
        return self._m

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (nothing changed) if the grammar refuses it. Unconstrained,
        every token is accepted; an EOS the grammar allows ends it."""
        if not self.constrained:
            self.num_free += 1
            return True
        if token in self._eos:  # allowed where the grammar accepts (consuming it is refused)
            if not self._m.is_accepting():
                return False
            self.num_free += 1
            return True
        # one call: a refused token is not consumed and leaves no error state
        consumed: int = self._m.try_consume_tokens([token])
        return consumed == 1

    def accept_free(self, tokens: Sequence[int]) -> None:
        """Advance by tokens already drawn under this matcher's masks; a refused one (no token
        was left by the other filters) frees the rest."""
        for t in tokens:
            if not self.accept(t):
                log.warning("a token outside the grammar was drawn; the rest is unconstrained")
                self.num_free += 1

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        free = min(num_tokens, self.num_free)
        self.num_free -= free
        if num_tokens > free:
            self._m.rollback(num_tokens - free)


def apply_mask(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, the logits of `rows` whose bit in `mask` (on logits' device, one
    row per logits row) is 0, and those past the mask's 32 * words tokens. The native kernel
    where it serves them (host CPU); torch ops unpacking the bits elsewhere."""
    if not native.apply_bitmask_(logits, mask, rows):
        _unpack_and_mask(logits, mask, rows)


def _unpack_and_mask(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
    """`apply_mask` in torch ops (any device), unpacking the bits into a [rows, words, 32]
    tensor."""
    vocab = logits.shape[-1]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    bits = (mask.index_select(0, index.to(mask.device))[:, :, None] >> shifts) & 1
    allowed = bits.reshape(len(rows), -1)[:, :vocab].bool().to(logits.device)
    if allowed.shape[1] < vocab:  # tokens past the mask's words: refused
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    sub = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, sub)


def _compile(tokenizer: Any, spec: GrammarSpec) -> Any:
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    make = llguidance.LLMatcher
    if spec.kind == "json":
        try:
            schema = json.loads(spec.spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON ({exc})") from None
        grammar = make.grammar_from_json_schema(json.dumps(closed(schema)), defaults=JSON_OPTIONS)
    elif spec.kind == "json_object":
        grammar = make.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    elif spec.kind == "regex":
        grammar = make.grammar_from_regex(spec.spec)
    elif spec.kind == "choice":  # Lark string literals take JSON's escapes
        options = json.loads(spec.spec)
        lark = "start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)
        grammar = make.grammar_from_lark(lark)
    elif spec.kind == "grammar":  # Lark, or GBNF (vLLM's EBNF) converted to it
        grammar = make.grammar_from_lark(any_to_lark(spec.spec))
    else:
        raise ValueError(f"unknown structured output kind {spec.kind!r}")
    matcher = make(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(matcher.get_error().strip())
    return matcher


def closed(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that leaves it unsaid
    (as xgrammar's and OpenAI's strict mode): the output holds the properties the schema names,
    and a small model cannot wander off into invented keys. Still a subset of what the schema
    accepts, so every output validates against the schema as sent."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    is_object = out.get("type") == "object" or isinstance(out.get("properties"), dict)
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if is_object and not any(k in out for k in open_keys):
        out["additionalProperties"] = False
    return out


def _what(spec: GrammarSpec) -> str:
    return {
        "json": "JSON schema (structured_outputs.json / response_format.json_schema)",
        "json_object": "JSON object grammar",
        "regex": "regex (structured_outputs.regex)",
        "choice": "choice list (structured_outputs.choice)",
        "grammar": "grammar (structured_outputs.grammar, Lark or GBNF)",
    }[spec.kind]

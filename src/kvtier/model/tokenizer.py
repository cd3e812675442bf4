"""Tokenizer of a HF folder: `tokenizer.json` through `tokenizers`, special tokens and the chat
template from `tokenizer_config.json` (or `chat_template.jinja`), eos ids merged with
`generation_config.json`. Raises ValueError naming the missing file and how to produce it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from kvtier.model.generation import load_generation_defaults


class Tokenizer:
    """Encode/decode plus the ids a generator needs (bos, eos set, pad)."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        bos_token_id: int | None = None,
        eos_token_ids: tuple[int, ...] = (),
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.special_tokens = special_tokens or {}

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # the batch entry point releases the GIL while it runs (plain `encode` holds it), so a
        # long prompt tokenized in a server worker thread does not stall the engine thread
        batch = self.tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return list(batch[0].ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render the chat template (jinja2, sandboxed) the way `transformers` does;
        `template_kwargs` are further variables (they may override the special tokens, never the
        messages, the tools or the generation prompt); `tools` (OpenAI's tool entries) reach the
        template as `tools`, None when the request has none."""
        if not self.chat_template:
            raise ValueError(
                "this tokenizer has no chat template; add `chat_template` to tokenizer_config.json "
                "or a chat_template.jinja file, or pass a plain prompt"
            )
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ValueError("chat templates need jinja2: `pip install jinja2`") from None

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = _tojson  # transformers' (jinja's own escapes <, > and &)
        variables = self.special_tokens | (template_kwargs or {})
        variables |= {"messages": messages, "add_generation_prompt": add_generation_prompt}
        variables["tools"] = tools
        return env.from_string(self.chat_template).render(**variables)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    """The `tojson` filter as `transformers` defines it for chat templates: plain JSON, text
    left unescaped (templates write tool schemas with it)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


def load_tokenizer(path: str | Path) -> Tokenizer:
    folder = Path(path)
    file = folder / "tokenizer.json"
    if not file.is_file():
        raise ValueError(
            f"{folder}: tokenizer.json is missing; save a fast tokenizer there with "
            "`AutoTokenizer.from_pretrained(...).save_pretrained(folder)`, or pass "
            "prompt_token_ids instead of text"
        )
    tok = HFTokenizer.from_file(str(file))
    cfg = _read_json(folder / "tokenizer_config.json")
    special = {
        name: text
        for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        if (text := _token_text(cfg.get(name)))
    }
    bos = tok.token_to_id(special["bos_token"]) if "bos_token" in special else None
    eos_ids = list(load_generation_defaults(folder).eos_token_ids)
    if "eos_token" in special:
        eos = tok.token_to_id(special["eos_token"])
        if eos is not None and eos not in eos_ids:
            eos_ids.append(eos)
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    jinja = folder / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text()
    return Tokenizer(tok, bos, tuple(eos_ids), template, special)


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data: dict[str, Any] = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: not valid JSON ({exc})") from None
    return data


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None

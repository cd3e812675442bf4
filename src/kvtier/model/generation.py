"""`generation_config.json` of a HF folder: the generation defaults it states (eos ids, bos,
sampling values). Read by the loader and the tokenizer alike, so it imports neither."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class GenerationDefaults:
    """What `generation_config.json` says (None where it is silent)."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None


def load_generation_defaults(path: str | Path) -> GenerationDefaults:
    """Read `generation_config.json` if present; an absent file gives empty defaults."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return GenerationDefaults()
    try:
        cfg: dict[str, Any] = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: not valid JSON ({exc})") from None
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return GenerationDefaults(
        eos_token_ids=eos_ids,
        bos_token_id=cfg.get("bos_token_id"),
        temperature=cfg.get("temperature"),
        top_k=cfg.get("top_k"),
        top_p=cfg.get("top_p"),
        min_p=cfg.get("min_p"),
    )

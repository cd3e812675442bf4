"""Request fields beyond a body's declared ones: vLLM's, sglang-router's and vllm-router's fields
this engine cannot honour, tolerated only at their neutral values, and every other unknown name
logged once and ignored, as vLLM does. Knows no request model and raises nothing."""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

log = logging.getLogger("kvtier.server")

# Fields of vLLM's, sglang-router's and vllm-router's bodies that this engine cannot honour:
# accepted at their neutral values (what the routers send when the client did not set them), a
# 400 naming them otherwise, never ignored while they would change the answer.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "length_penalty": (None, 1.0),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "logits_processors": (None, []),
    "structural_tag": (None,),
    "spaces_between_special_tokens": (None, True),
    "cache_salt": (None,),
    "vllm_xargs": (None, {}),
    "kv_transfer_params": (None,),
    "prompt_embeds": (None,),
    "mm_processor_kwargs": (None, {}),
    # sglang-router and vllm-router extensions
    "no_stop_trim": (None, False),
    "return_hidden_states": (None, False),
    "regex": (None,),
    "ebnf": (None,),
    "json_schema": (None,),
    "lora_path": (None,),
    "sampling_seed": (None,),
}
CHAT_NEUTRAL = NEUTRAL | {
    "echo": (None, False),
    "chat_template": (None,),
    "documents": (None, []),
}
COMPLETION_NEUTRAL = NEUTRAL | {"suffix": (None, "")}

_warned: set[str] = set()
_warned_lock = threading.Lock()


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    for v in neutral:
        if v is None:
            if value is None:
                return True
        elif isinstance(v, float):  # 1 and 1.0 alike, but never True for 1.0
            if isinstance(value, int | float) and not isinstance(value, bool) and value == v:
                return True
        elif type(value) is type(v) and value == v:
            return True
    return False


def unsupported_field(
    extras: dict[str, Any], neutral: dict[str, tuple[Any, ...]]
) -> tuple[str, str] | None:
    """The first field of `extras` that `neutral` lists at another value, with the values it
    accepts (as JSON); None when there is none. Every other name of `extras` is logged the
    first time it is seen (then ignored)."""
    for name, value in extras.items():
        if name in neutral:
            if not _is_neutral(value, neutral[name]):
                return name, " or ".join(json.dumps(v) for v in neutral[name])
            continue
        with _warned_lock:
            if name in _warned:
                continue
            _warned.add(name)
        log.warning("request field %r is not used by this server and was ignored", name)
    return None

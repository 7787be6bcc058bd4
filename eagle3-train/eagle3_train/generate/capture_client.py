"""01b --capture-hidden-states' side of a request: the body asks the connector to save the answer's
states too, and the response must name the file they were saved to."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

from eagle3_train.common.client import ChatClient, Outcome, ResponseError


@dataclass
class CaptureClient(ChatClient):
    """01b's client, keeping the response's `kv_transfer_params.hidden_states_path` in the answer;
    with `room` (Capture.room, --max-store-gb) each request waits for room in the store first."""

    room: Callable[[], None] | None = None

    async def complete(self, body: bytes, prefer=None) -> Outcome:
        if self.room is not None:  # on a thread: the answers in flight are still collected meanwhile
            await asyncio.to_thread(self.room)
        return await super().complete(body, prefer)

    def parse(self, content: bytes) -> dict:
        answer = super().parse(content)
        kv = json.loads(content).get("kv_transfer_params") or {}
        path = kv.get("hidden_states_path") if isinstance(kv, dict) else None
        if not path:
            raise ResponseError("no_hidden_states_path", "the response has no kv_transfer_params."
                                "hidden_states_path: was the server started with the command "
                                "01b --capture-hidden-states prints?", False)
        answer["hidden_states_path"] = path
        return answer


def extra_body(user: dict) -> dict:
    """--extra-body plus the option that makes the connector save the answer's states too."""
    kv = dict(user.get("kv_transfer_params") or {})
    return {**user, "kv_transfer_params": {**kv, "include_output_tokens": True}}

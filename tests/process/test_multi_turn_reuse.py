"""A real ``twistd nixlproxy`` configured for multi-turn reuse by its TOML file, between fakes
that do vLLM's bidirectional transfer: the next turn reads its KV back, and no answer
carries decode's handle."""

from __future__ import annotations

import json
from typing import Any

from tests.process.support import TwistdCase

SYSTEM = {"role": "system", "content": "You answer questions on the NIXL transfer. " * 12}
FIRST = [SYSTEM, {"role": "user", "content": "How does decode pull the KV?"}]


class MultiTurnReuseTests(TwistdCase):
    async def test_a_configured_proxy_reads_the_next_turns_kv_back(self) -> None:
        await self.start(bidirectional=True, decoder_blocks_ttl=60.0)
        config = self.config_file(
            self.decode.url, more="multi-turn-reuse = true\nreuse-handle-ttl = 60\n"
        )
        process = self.spawn("--listen", "tcp:0:interface=127.0.0.1", "--config", config)
        url = f"http://{await process.listening}"

        async def turn(messages: list[dict[str, Any]]) -> dict[str, Any]:
            body = {"model": "fake-model", "messages": messages}
            response = await self.http.post(url + "/v1/chat/completions", json=body)
            raw = await response.content()
            assert response.code == 200, raw
            assert b"kv_transfer_params" not in raw
            said: dict[str, Any] = json.loads(raw)
            return said

        first = await turn(FIRST)
        content = first["choices"][0]["message"]["content"]
        await turn(
            [*FIRST, {"role": "assistant", "content": content}, {"role": "user", "content": "And?"}]
        )
        (read,) = self.prefill.handles_read
        assert read["extends"] and read["pulled"] > 0
        await self.terminate(process)

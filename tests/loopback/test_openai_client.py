"""The official ``openai`` client as the caller, streaming and not."""

from __future__ import annotations

from typing import Any

import openai
from twisted.internet.threads import deferToThread

from tests.support import ProxyCase

EXPECTED = "Hello from the fake decode instance: "


class OpenAIClientTests(ProxyCase):
    async def client(self, **fake_options: Any) -> openai.OpenAI:
        await self.start(tokens=6, **fake_options)
        client = openai.OpenAI(
            base_url=self.proxy.url + "/v1", api_key="sk-client", max_retries=0, timeout=20
        )
        self.addCleanup(client.close)
        return client

    async def test_streaming_chat(self) -> None:
        client = await self.client()

        def call() -> tuple[str, Any]:
            stream = client.chat.completions.create(
                model="fake-model",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                stream_options={"include_usage": True},
            )
            text, usage = "", None
            for chunk in stream:
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                usage = chunk.usage or usage
            return text, usage

        text, usage = await deferToThread(call)
        self.assertEqual(text, EXPECTED)
        self.assertEqual(usage.completion_tokens, 6)
        self.assertEqual(self.prefill.requests[0].authorization, "Bearer sk-client")
        self.assertEqual(self.decode.requests[0].authorization, "Bearer sk-client")

    async def test_chat(self) -> None:
        client = await self.client()

        def call() -> Any:
            return client.chat.completions.with_raw_response.create(
                model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )

        raw = await deferToThread(call)
        completion = raw.parse()
        self.assertEqual(completion.choices[0].message.content, "Hello from the ")
        self.assertEqual(completion.choices[0].finish_reason, "length")
        self.assertEqual(raw.headers["x-request-id"], self.decode.requests[0].request_id)

    async def test_streaming_completions(self) -> None:
        client = await self.client()

        def call() -> str:
            stream = client.completions.create(model="fake-model", prompt="hi", stream=True)
            return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

        self.assertEqual(await deferToThread(call), EXPECTED)

    async def test_completions(self) -> None:
        client = await self.client()

        def call() -> Any:
            return client.completions.create(model="fake-model", prompt="one two three four")

        completion = await deferToThread(call)
        self.assertEqual(completion.choices[0].text, EXPECTED)
        self.assertEqual(completion.usage.prompt_tokens_details.cached_tokens, 2)

    async def test_batched_prompts_are_served_one_pair_each(self) -> None:
        client = await self.client()

        def call() -> Any:
            return client.completions.create(model="fake-model", prompt=["a", "b"])

        completion = await deferToThread(call)
        self.assertEqual([c.index for c in completion.choices], [0, 1])
        self.assertEqual(len(self.prefill.requests), 2)

    async def test_models(self) -> None:
        client = await self.client()
        models = await deferToThread(lambda: client.models.list())
        self.assertEqual([m.id for m in models.data], ["fake-model"])


class SeveralModelsTests(ProxyCase):
    """Two models on their own instances, as each one's ``/v1/models`` says over HTTP."""

    async def test_the_client_lists_the_union_and_each_model_reaches_its_instances(self) -> None:
        await self.start(prefills=2, decodes=2, proxy={"health_interval": 5})
        for fakes in (self.prefills, self.decodes):
            fakes[0].model, fakes[1].model = "llama", "qwen"
            fakes[1].adapters = ("qwen-sql",)
        await self.proxy.service.checks.check_health()
        client = openai.OpenAI(
            base_url=self.proxy.url + "/v1", api_key="sk-client", max_retries=0, timeout=20
        )
        self.addCleanup(client.close)

        def call() -> tuple[list[str], list[str], Any]:
            listed = [model.id for model in client.models.list()]
            said = []
            for model in ("qwen", "llama", "qwen-sql"):
                completion = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
                said.append(completion.model)
            try:
                client.chat.completions.create(
                    model="mistral", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
            except openai.NotFoundError as error:
                return listed, said, error
            raise AssertionError("an unknown model was served")

        listed, said, refused = await deferToThread(call)
        self.assertEqual(listed, ["llama", "qwen", "qwen-sql"])
        self.assertEqual(said, ["qwen", "llama", "qwen-sql"])
        self.assertEqual(refused.code, "model_not_found")
        for fakes in (self.prefills, self.decodes):
            sent = [
                [(r.body or {})["model"] for r in f.requests if r.method == "POST"] for f in fakes
            ]
            self.assertEqual(sent, [["llama"], ["qwen", "qwen-sql"]])

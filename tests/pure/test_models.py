"""Several models: the ``[models.NAME]`` table, which instance serves what, the resolution."""

from __future__ import annotations

import json
from typing import Any

import pytest

from nixl_twisted.backends import health
from nixl_twisted.backends.health import State
from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.models import (
    ModelRequired,
    UnknownModel,
    context_length,
    listing,
    read_models,
    resolve,
)
from nixl_twisted.config import ConfigError, ProxyConfig
from nixl_twisted.config.models import MODEL_KEYS, ModelPools, model_table
from nixl_twisted.config.settings import BY_NAME
from nixl_twisted.config.values import InvalidValue
from nixl_twisted.testing import answers

TABLE = {
    "llama": {
        "prefill": ["http://10.0.0.1:8100"],
        "decode": ["http://10.0.0.2:8200#dp=2"],
        "decode-policy": "session",
        "decode-only-below": 64,
    },
    "qwen": {"decode": ["http://10.0.1.2:8200"], "prefill-fallback": "decode"},
}


def make(**settings: Any) -> ProxyConfig:
    return ProxyConfig.create(**settings)


# -- the table -----------------------------------------------------------------


def test_a_table_reads_as_the_options_do_and_reads_back_to_itself() -> None:
    parsed = model_table(TABLE)
    assert parsed == (
        ModelPools(
            "llama",
            ("http://10.0.0.1:8100",),
            ("http://10.0.0.2:8200#dp=2",),
            (("decode-only-below", 64), ("decode-policy", "session")),
        ),
        ModelPools("qwen", (), ("http://10.0.1.2:8200",), (("prefill-fallback", "decode"),)),
    )
    assert model_table(parsed) == parsed
    assert model_table(json.dumps(TABLE)) == parsed  # (the command line's JSON)
    config = make(prefill=["http://p:1"], decode=["http://d:2"], models=TABLE)
    assert ProxyConfig.from_json(config.to_json()) == config  # (what a worker is handed)


def test_a_tables_keys_take_underscores_as_the_top_level_does() -> None:
    underscored: dict[str, dict[str, Any]] = {
        "llama": {
            "prefill": ["http://10.0.0.1:8100"],
            "decode": ["http://10.0.0.2:8200#dp=2"],
            "decode_policy": "session",
            "decode_only_below": 64,
        },
        "qwen": {"decode": ["http://10.0.1.2:8200"], "prefill_fallback": "decode"},
    }
    assert model_table(underscored) == model_table(TABLE)


@pytest.mark.parametrize(
    ("table", "said"),
    [
        ({"m": {"weights": 3}}, "model 'm': unknown key 'weights' (the keys are prefill, decode"),
        ({"m": {"decode_policy": "rr"}}, "model 'm': decode-policy must be one of"),
        (
            {"m": {"decode-only-below": 1, "decode_only_below": 2}},
            "model 'm': 'decode-only-below' and 'decode_only_below' are one key: give it once",
        ),
        ({"m": ["http://d:2"]}, "model 'm': must be a table of prefill, decode,"),
        ({"m": {"decode-policy": "fastest"}}, "model 'm': decode-policy must be one of"),
        ({"m": {"decode": "http://d:2"}}, "model 'm': decode must be a list of URLs"),
        ({"m": {"decode": ["ftp://d:2"]}}, "model 'm': decode "),
        ({"m": {"prefill-busy-at": 0}}, "model 'm': prefill-busy-at must be at least 1"),
        ({"a b": {}}, "model 'a b': a name is printable, without whitespace"),
        ("[1, 2]", "must be rows of (model, prefill, decode, own)"),
        ("{", "must be a table of models"),
        (7, "must be a table of models"),
    ],
)
def test_a_wrong_table_says_which_model_and_key(table: object, said: str) -> None:
    with pytest.raises(InvalidValue) as refused:
        model_table(table)
    assert said in str(refused.value)


@pytest.mark.parametrize("key", list(MODEL_KEYS))
def test_each_key_is_parsed_as_its_top_level_setting(key: str) -> None:
    """A model's key takes what the option takes, and refuses what it refuses."""
    setting = BY_NAME[key]
    for value in [
        "http://d:2",
        "dns+http://d:2",
        "ftp://d",
        "session",
        "nope",
        0,
        1,
        64,
        -1,
        "decode",
    ]:
        outcomes = []
        for parse in (setting.parse, MODEL_KEYS[key]):
            try:
                outcomes.append(("took", parse(value)))
            except InvalidValue:
                outcomes.append(("refused", None))
        assert outcomes[0] == outcomes[1], (key, value)


def test_models_alone_may_give_the_pools() -> None:
    config = make(models=TABLE)
    assert config.pools.of("decode") == ("http://10.0.0.2:8200#dp=2", "http://10.0.1.2:8200")
    assert config.pools.named("decode")["http://10.0.1.2:8200"] == {"qwen"}
    with pytest.raises(ConfigError, match="at least one --prefill URL"):
        make(models={"qwen": TABLE["qwen"]})  # (no prefill instance anywhere)


def test_a_models_rules_are_the_top_levels_but_for_what_it_gives() -> None:
    config = make(prefill=["http://p:1"], decode=["http://d:2"], models=TABLE, prefill_busy_at=3)
    assert config.rules_for(None) is config.disaggregation
    assert config.rules_for("other") is config.disaggregation
    llama = config.rules_for("llama")
    assert (llama.short_prompt, llama.busy_at, llama.fallback) == (64, 3, "none")
    assert config.rules_for("qwen").fallback == "decode"


# -- what instances serve ----------------------------------------------------------


def decode(
    url: str,
    models: list[str] | None = None,
    named: frozenset[str] = frozenset(),
    context: int = 1024,
) -> Instance:
    instance = Instance(url, "decode", state=State.UP, named=named)
    if models is not None:
        instance.models = read_models(answers.models(models[0], models[1:], 0, context))
    return instance


def test_vllms_answer_is_read_as_cards_by_id_lora_adapters_included() -> None:
    cards = read_models(answers.models("llama", ["sql-lora"]))
    assert list(cards) == ["llama", "sql-lora"]
    assert cards["sql-lora"]["parent"] == "llama"
    for wrong in (b"[]", b'{"data": 3}', b"not json"):
        with pytest.raises(ValueError):
            read_models(wrong)


def test_an_instance_serves_what_it_said_else_what_it_is_listed_for_else_anything() -> None:
    said = decode("http://a", ["llama", "sql-lora"])
    assert said.serves("sql-lora") and not said.serves("qwen")
    assert decode("http://b").serves("anything")  # (never read: as before models were read)
    listed = decode("http://c", named=frozenset({"qwen"}))
    assert listed.serves("qwen") and not listed.serves("llama")
    assert listed.not_serving == []  # (not said yet: the table is believed)
    wrong = decode("http://d", ["llama"], named=frozenset({"qwen"}))
    assert wrong.serves("llama") and not wrong.serves("qwen")  # (vLLM would refuse qwen)
    assert wrong.not_serving == ["qwen"] == wrong.status()["not_serving"]
    right = decode("http://e", ["qwen"], named=frozenset({"qwen"}))
    assert right.serves("qwen") and right.not_serving == []
    with pytest.raises(UnknownModel):
        resolve("qwen", [wrong])
    empty = decode("http://f", named=frozenset({"qwen"}))
    empty.models = {}  # (it said: nothing)
    with pytest.raises(UnknownModel):
        resolve("qwen", [empty])


def test_a_request_is_resolved_against_what_the_decode_instances_serve() -> None:
    fleet = [decode("http://a", ["llama", "sql-lora"]), decode("http://b", ["qwen"])]
    assert resolve("sql-lora", fleet) == ("sql-lora", True)
    with pytest.raises(UnknownModel):
        resolve("mistral", fleet)
    with pytest.raises(ModelRequired, match="llama, qwen, sql-lora"):
        resolve(None, fleet)
    assert resolve(7, fleet) == (None, False)  # (vLLM's to refuse)
    one = [decode("http://a", ["llama"])]
    assert resolve(None, one) == (None, False)  # one model: as today
    unread = [*fleet, decode("http://c")]
    assert resolve("mistral", unread) == ("mistral", False)  # the unread one may serve it
    assert resolve("mistral", [decode("http://c")]) == (None, False)  # nothing known
    draining = decode("http://d", ["mistral"])
    draining.draining = True
    with pytest.raises(UnknownModel):
        resolve("mistral", [*fleet, draining])


def test_the_listing_is_each_model_of_the_healthy_decode_instances_once() -> None:
    down = decode("http://c", ["mistral"])
    down.state = State.DOWN
    fleet = [
        decode("http://a", ["llama", "sql-lora"]),
        decode("http://b", ["llama"]),
        decode("http://d", named=frozenset({"qwen"})),
        down,
    ]
    listed = listing(fleet)
    assert listed is not None
    assert [card["id"] for card in listed["data"]] == ["llama", "qwen", "sql-lora"]
    assert listed["data"][2]["parent"] == "llama"  # (vLLM's card, as it said it)
    assert listing([decode("http://e")]) is None  # none said: one instance is asked


def test_a_models_context_is_the_largest_its_cards_say_an_adapters_its_parents() -> None:
    fleet = [
        decode("http://a", ["llama", "sql-lora"], context=8192),
        decode("http://b", ["llama"], context=4096),
        decode("http://c", ["qwen"], context=32768),
        decode("http://d"),  # (never read: says nothing)
    ]
    assert context_length("llama", fleet) == 8192
    assert context_length("sql-lora", fleet) == 8192  # (its card has none: its parent's)
    # A model no card names, or none named: the largest any card says.
    assert context_length("mistral", fleet) == context_length(None, fleet) == 32768
    assert context_length(7, fleet) == 32768
    fleet[2].draining = True
    assert context_length(None, fleet) == 8192
    assert context_length("llama", [decode("http://e")]) is None
    odd = decode("http://f", ["llama"])
    assert odd.models is not None
    odd.models["llama"]["max_model_len"] = "8192"  # (not vLLM's shape: says nothing)
    assert context_length("llama", [odd]) is None


def test_workers_are_told_what_each_instance_serves() -> None:
    supervisor = decode("http://a", ["llama"])
    worker = decode("http://a")
    health.adopt(worker, json.loads(json.dumps(supervisor.health())))
    assert worker.models == supervisor.models
    assert supervisor.status()["models"] == ["llama"]

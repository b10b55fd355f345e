from twisted.application.service import ServiceMaker

nixlproxy = ServiceMaker(
    "nixl-twisted proxy",
    "nixl_twisted.tap",
    "Proxy for vLLM disaggregated prefill/decode serving over NIXL.",
    "nixlproxy",
)

"""A registered experience codec for the built-in comm stage (``comm.codec: example-bf16``): floats as bfloat16,
everything else as the built-in codecs send it. Built from the registry on both ends (worker and trainer)."""

from mrl_plugins.comm.codec import Codec
from mrl_plugins.hookspecs import CommCodec, hookimpl


class ExampleBf16(Codec):
    def __init__(self, lossless_fields=()):
        super().__init__("bf16", lossless_fields)
        self.name = "example-bf16"

    def __reduce__(self):
        return (ExampleBf16, (tuple(self.lossless_fields),))


class ExampleCodecs:
    @hookimpl
    def mrl_comm_register_codecs(self):
        yield CommCodec("example-bf16", lambda config: ExampleBf16(config.lossless_fields), "floats as bfloat16")


plugin = ExampleCodecs()

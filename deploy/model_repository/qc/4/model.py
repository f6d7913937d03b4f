"""A deliberately broken version: loading it fails, which tests that a failed load leaves
the serving versions alone. Not loaded at start (config.pbtxt lists versions 1-3)."""


class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("version 4 is broken on purpose (sample repository)")

    def execute(self, requests):
        raise RuntimeError("unreachable")

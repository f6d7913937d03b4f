"""Developer tools, not serving code: a local Triton, the demo, the settings reference."""

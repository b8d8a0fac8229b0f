"""Benchmarks; importing `engine` first gives them the engine's TF defaults."""
import engine  # noqa: F401  pylint: disable=unused-import

"""Public entry point for Ray Data pipelines: `from nanoinfer.ray import NanoinferPredictor`."""

from nanoinfer.jobs.ray_data import RECORD_FIELDS, NanoinferPredictor

__all__ = ["RECORD_FIELDS", "NanoinferPredictor"]

"""The Prometheus exporter's public path (it lives in ``ops.metrics``)."""

from .ops.metrics import BufferMetrics, CounterSample, counter_sample

__all__ = ["BufferMetrics", "CounterSample", "counter_sample"]

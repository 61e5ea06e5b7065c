"""Why is my GPU idle or slow: device counters (NVML/GPM), the allocator, the host and the loop's own events,
joined, and the bottleneck named with its fix (``gpuwise.Monitor``, ``gpuwise watch``)."""

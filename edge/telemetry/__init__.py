"""What a device reports about itself, and where it goes.

readings.py (`SystemSampler`, the Telemetry message's contents), tegrastats.py (Jetson
readings), cpu_info.py (/proc/cpuinfo), publisher.py (retained telemetry on the star),
metrics_http.py (Prometheus /metrics).

May import: edge.wire (and below).
"""

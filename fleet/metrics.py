"""The controller's Prometheus metrics (`jetserve_fleet_*`), served at `/metrics` on its HTTP side.

What an operator needs to see that ingestion keeps up and what it refuses: messages by kind and
outcome (refused ones included), the queue between the MQTT thread and the registry writer, the
size and time of each registry transaction, and the registry lag (device timestamp → commit).
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LAG_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
COMMIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.messages = Counter(
            "jetserve_fleet_messages", "Inbound messages by topic kind and outcome (rejected: failed its checks; "
            "failed: the registry refused it alone; ignored: not a jetserve topic)", ["kind", "outcome"], registry=r)
        self.received = Counter("jetserve_fleet_received", "Messages taken from the broker, stored or not yet",
                                registry=r)
        self.queue_depth = Gauge("jetserve_fleet_queue_depth_messages",
                                 "Messages received and waiting for the registry writer", registry=r)
        self.queue_capacity = Gauge("jetserve_fleet_queue_capacity_messages",
                                    "Bound of that queue in messages (also the MQTT Receive Maximum)", registry=r)
        self.queue_bytes = Gauge("jetserve_fleet_queue_bytes", "Payload bytes of the messages in that queue",
                                 registry=r)
        self.queue_capacity_bytes = Gauge("jetserve_fleet_queue_capacity_bytes",
                                          "Bound of that queue in payload bytes", registry=r)
        self.batch = Histogram("jetserve_fleet_batch_messages", "Messages stored per registry transaction",
                               buckets=BATCH_BUCKETS, registry=r)
        self.commit = Histogram("jetserve_fleet_commit_seconds", "Time of one registry transaction",
                                buckets=COMMIT_BUCKETS, registry=r)
        self.lag = Histogram("jetserve_fleet_registry_lag_seconds",
                             "From the timestamp a device put in a message to its commit in the registry "
                             "(device clocks: negative lags count as 0)", buckets=LAG_BUCKETS, registry=r)
        self.store_errors = Counter("jetserve_fleet_store_errors",
                                    "Registry transactions the database could not do (tried again)", registry=r)

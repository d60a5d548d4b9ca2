"""The cluster: brokers on many hosts over NATS JetStream."""

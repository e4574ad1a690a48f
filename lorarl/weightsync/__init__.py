"""lorarl: lorarl/weightsync — policy versions from trainer to rollout; control over gRPC, bytes out of band.

Three packages, each importing only those above it in this list:
  wire/     the format both sides share: payload (buckets, manifests, xxh64 checks), collective (a gloo /
            nccl / hccl group apart from any training group), inline (gRPC chunks), net (which local
            address peers reach), catalog (a manifest against its job), merge (local merge of an adapter)
  client/   what other processes embed: publisher (trainer side: register, publish, await activation),
            agent (rollout side: subscribe, receive, verify, hand to a PolicySink), sinks, activation
  service/  `lorarl serve weightsync`: server (thin servicer), core (the behaviour on one event loop),
            registry (jobs and versions), modes (AUTO resolution), planning (who receives what, how),
            rounds (two-phase activation), replicas, store (durable jobs, manifests, adapters), config
The client side imports nothing from the service side (tests/unit/test_architecture.py).
"""

"""lorarl: services/weightsync — policy versions from trainer to rollout; control over gRPC, bytes out of band.

Service side (`lorarl serve weightsync`):
  server     thin WeightSyncService servicer; start_weightsync / serve_forever
  core       the service's behaviour on one event loop: wires the parts below together
  registry   jobs and versions: forward-only numbering, validation, duplicates, durable write-through
  catalog    a manifest against its job: PEFT names on catalog modules, LoRA / merged shapes and dtypes
  modes      AUTO resolution (adapter vs merged) and how each replica serves (adapter, merged, local merge)
  planning   who receives a version and how: collective rendezvous or inline
  rounds     two-phase activation (stage everywhere, then commit), timeouts, blame attribution
  replicas   subscribed replicas: capabilities, connection, per-job versions, event outbox
  store      durable jobs, manifests (protobuf binary + JSON) and adapters (safetensors), atomic writes
  config     the `weightsync:` settings

Shared by both sides:
  payload    buckets, manifests, xxh64 checks (whole and streaming: PayloadVerifier)
  collective WeightTransferGroup: a gloo / nccl / hccl group apart from any training group
  inline     gRPC chunks and their reassembly
  net        which local address peers can reach

Clients:
  publisher  trainer side: WeightPublisher (register, publish, await activation)
  agent      rollout side: WeightSyncAgent (subscribe, receive, verify, hand to a PolicySink), AgentThread
  sinks      PolicySink protocol, PolicyUpdate, InMemorySink
  merge      local merge of an adapter into base weights (bit-identical to the trainer's merge)
"""

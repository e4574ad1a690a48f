"""lorarl: lorarl/common — what every service shares.

config         typed dataclass configs: YAML -> env -> overrides -> validation (ConfigError)
server_config  the `server:` section (ServerConfig, AuthConfig, TlsConfig)
server         grpc.aio bootstrap: start_server / RunningServer / serve
auth           bearer tokens: sources, constant-time check, server interceptor
channel        client channels with token and TLS (aio_channel, sync_channel)
errors         exceptions that mean a gRPC status, translated at the servicer boundary
metrics        Prometheus RPC metrics, interceptor and HTTP endpoint
log            JSON-lines or text logging
ready          ready files that tell a parent which ports a server got
handlers       wrapping method handlers of any arity (used by the interceptors)
"""

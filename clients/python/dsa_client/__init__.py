"""dsa_client: a Python client of the dsa-indexer services for routers.

CoordinatorClient (client.py) wraps dsa.coordinator.v1's CoordinatorService and the health check,
AsyncCoordinatorClient the same for asyncio (grpc.aio) (tls_credentials builds TLS / mutual TLS credentials from PEM files; connect takes a bearer token);
dsa_client.generate tokenizes a prompt for a real model and streams its text
(`python -m dsa_client.generate --target HOST:PORT --tokenizer tokenizer.json "prompt"`);
the generated messages and stubs of every service are under dsa_client.proto.dsa.<service>.v1
(regenerate them with clients/python/generate.sh).
"""

from dsa_client.client import (DEFAULT_GENERATE_TIMEOUT_S, HEALTH_SERVICE_NAMES,
                               AsyncCoordinatorClient, AsyncGeneration, CoordinatorClient,
                               Generation, Overrides, Sampling, tls_credentials)

__all__ = ["CoordinatorClient", "AsyncCoordinatorClient", "Generation", "AsyncGeneration",
           "Overrides", "Sampling", "HEALTH_SERVICE_NAMES", "DEFAULT_GENERATE_TIMEOUT_S",
           "tls_credentials"]

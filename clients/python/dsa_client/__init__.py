"""dsa_client: a Python client of the dsa-indexer services for routers.

CoordinatorClient (client.py) wraps dsa.coordinator.v1's CoordinatorService and the health check
(tls_credentials builds TLS / mutual TLS credentials from PEM files; connect takes a bearer token);
dsa_client.generate tokenizes a prompt for a real model and streams its text
(`python -m dsa_client.generate --target HOST:PORT --tokenizer tokenizer.json "prompt"`);
the generated messages and stubs of every service are under dsa_client.proto.dsa.<service>.v1
(regenerate them with clients/python/generate.sh).
"""

from dsa_client.client import (HEALTH_SERVICE_NAMES, CoordinatorClient, Generation, Overrides,
                               Sampling, tls_credentials)

__all__ = ["CoordinatorClient", "Generation", "Overrides", "Sampling", "HEALTH_SERVICE_NAMES",
           "tls_credentials"]

"""`python -m pagedllm.bench {throughput,latency,serve,compare} ...`."""

from pagedllm.bench import cli

cli()

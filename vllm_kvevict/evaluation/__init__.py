"""Critical-KV-footprint evaluation through the real server: generated long-context tasks
(tasks.py), a resumable grid runner over live `vllm serve` processes (runner.py) and the
paper's table and Pareto plot (report.py). See README.md in this directory."""

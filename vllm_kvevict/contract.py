"""`python -m vllm_kvevict.contract`: the vLLM names the plugin relies on, looked up on the installed
vLLM, and whether the plugin can activate here (integration/plugins/contract_report.py)."""

from vllm_kvevict.integration.plugins.contract_report import main

if __name__ == "__main__":
    raise SystemExit(main())

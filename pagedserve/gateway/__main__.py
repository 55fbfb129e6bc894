"""``python -m pagedserve.gateway --config FILE`` (same as ``pagedserve gateway``)."""

from pagedserve.gateway.cli import main

raise SystemExit(main())

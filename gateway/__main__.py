from __future__ import annotations

from gateway.cli import main

raise SystemExit(main())

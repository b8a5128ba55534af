from spd.cli import main

raise SystemExit(main())

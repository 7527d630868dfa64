from meshnode.cli import main

raise SystemExit(main())

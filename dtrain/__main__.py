from dtrain.cli.main import main

raise SystemExit(main())

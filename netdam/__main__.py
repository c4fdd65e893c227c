from netdam.cli.main import main

raise SystemExit(main())

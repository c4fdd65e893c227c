from netdam.cli import main

raise SystemExit(main())

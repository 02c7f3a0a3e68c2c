from rlfuse.cli import main

raise SystemExit(main())

"""The `xronos` command line. May import every plane; each subcommand imports its heavy parts lazily."""

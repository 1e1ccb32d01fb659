"""The run configuration: schema (frozen dataclasses), rules, command line and run files."""

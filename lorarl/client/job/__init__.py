"""What a job is: its file (config), inputs (data, reward, workflow, user imports) and the --dry-run plan."""

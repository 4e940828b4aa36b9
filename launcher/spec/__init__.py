"""What a user writes and where lmlaunch keeps it on the login node: job files (YAML plus dotted
overrides, validated with the line of every key), cluster profiles (shipped and the user's own,
drafts read off a live cluster), the nodes a user excludes per profile, and the user's lmlaunch
home.

May import: lmcore and launcher.runs. Not planning, submission, monitoring or commands.
"""

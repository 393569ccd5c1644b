"""Registry of harness notes: messages a harness adds in the model's name (role assistant) that
the model never wrote. One module per harness registers its notes here."""

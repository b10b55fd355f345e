"""The client side: the Klein app, the admin API, admission, and the site that takes connections."""

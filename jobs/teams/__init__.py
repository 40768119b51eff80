"""Teams (课题组): making one, invitations, roles, caps and removal (services.py)."""

"""How a researcher reaches their nodes: the SSH gateway (ssh, scp/sftp, ssh -L) and the
web apps in a workspace (JupyterLab, TensorBoard, a port) that the console proxies.

Modules, bottom to top (each imports only modules listed before it):
- hostkey: the gateway's host key on disk and its fingerprint, as the console shows it;
- sessions: a login to a node's workspace (admit, workspace_up, Refused) and the
  sessions per researcher counted in Redis, shared by the gateway and the web terminal;
- streams: an exec in a workspace as the tenant and its stream to the event loop
  (EngineStream), shared by the gateway, the web terminal and the apps' proxy;
- sftp: the per-session sftp containers;
- admission: who may log in and stay logged in (the database) and failed log-ins per
  address (django-axes);
- leftovers: each gateway process among the others (Redis), and what a killed one left
  running in the workspaces, hung up by the next;
- ssh: the asyncssh server and the `gateway` process (manage.py suanli_gateway);
- webapps: the workspace apps' rows, ports and whether they answer.

Only the gateway process imports asyncssh (admission, ssh): the web process imports
hostkey, sessions, streams and webapps (tests/test_web_imports.py).

Layer: access, beside runs and images; uses nodes and below.
"""

"""How a researcher reaches their nodes: the SSH gateway (ssh, scp/sftp, ssh -L) and the
web apps in a workspace (JupyterLab, TensorBoard, a port) that the console proxies.

Layer: access, beside runs and images; uses nodes and below.
"""
